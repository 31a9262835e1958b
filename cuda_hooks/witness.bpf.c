// kvguard wire witness: what watched processes write to their TCP connections, and what their
// threads copy with the CUDA runtime and driver while they name a transfer, seen from the
// kernel, with no change to the process. Compiled by bcc (cuda_hooks/witness.py), which passes
// HEAD (bytes of each write captured for the user-side decoder), MAX_RUNS and RING_PAGES (the
// size of the connection events' ring buffer) as -D...
//
// Invariants: only processes in `watched` are reported, and of their file descriptors only
// those that connect()ed to, or were accept()ed from, an IPv4/IPv6 peer; every such write
// is one event (its length as the kernel returned it, and its first HEAD bytes), every
// connect, accept and close of such a descriptor is one event, in the order the process
// made them: one ring buffer shared by all CPUs keeps that order (per-CPU perf buffers do
// not: a thread that moved to another CPU between its connect and its first write had them
// read the other way round). An event with no room is dropped and counted in `drops`, and the
// next event carries the count, so the reader knows where in the order the loss fell.
// A CUDA copy call counts once, under the transfer its thread named last
// (kvguard_xfer_begin ... kvguard_xfer_end), by the outermost probed function (the runtime's
// cudaMemcpy calls the driver's copy: that inner call is not counted again), in `bytes` when
// it returned success and in `failed_bytes` otherwise (a transfer with no copy call is no
// observation: the user side reports none). Nothing here blocks or changes the process.

#include <uapi/linux/ptrace.h>
#include <linux/socket.h>
#include <linux/uio.h>

#define KIND_WRITE 1
#define KIND_OPEN 2
#define KIND_CLOSE 3

struct pending {
    u64 buf;   // user address of the bytes written (write, sendto), or of the iovec array (sendmsg)
    u32 fd;
    u32 iov;   // 1: buf is an iovec array
};

struct event {
    u32 kind;
    u32 pid;
    u32 fd;
    u32 captured;  // bytes of head filled
    s64 bytes;     // what the write returned (negative: an error)
    u64 drops;     // events dropped before this one (all ring buffers): a rise means a gap here
    u8 head[HEAD];
};

BPF_HASH(watched, u32, u32);           // tgid -> 1
BPF_HASH(inet, u64, u8, 65536);        // (tgid << 32 | fd) -> 1: a TCP descriptor of a watched process
BPF_HASH(connecting, u64, u32);        // tid -> fd of a connect() to an inet address in progress
BPF_HASH(accepting, u64, u64);         // tid -> user address of the peer address an accept4() fills
BPF_HASH(writing, u64, struct pending);
BPF_PERCPU_ARRAY(scratch, struct event, 1);
BPF_ARRAY(drops, u64, 1);  // events no ring buffer had room for, in all
BPF_RINGBUF_OUTPUT(events, RING_PAGES);

static __always_inline u64 drops_so_far(void) {
    int zero = 0;
    u64 *n = drops.lookup(&zero);
    return n ? *n : 0;
}

static __always_inline void dropped(long failed) {
    int zero = 0;
    u64 *n = drops.lookup(&zero);
    if (failed && n)
        lock_xadd(n, 1);
}

static __always_inline u64 conn_key(u32 tgid, u32 fd) { return ((u64)tgid << 32) | fd; }

static __always_inline int watching(u64 id) {
    u32 tgid = id >> 32;
    return watched.lookup(&tgid) != 0;
}

static __always_inline void announce(void *ctx, u32 kind, u32 pid, u32 fd) {
    int zero = 0;
    struct event *e = scratch.lookup(&zero);
    if (!e)
        return;
    e->kind = kind;
    e->pid = pid;
    e->fd = fd;
    e->captured = 0;
    e->bytes = 0;
    e->drops = drops_so_far();
    dropped(events.ringbuf_output(e, offsetof(struct event, head), 0));
}

static __always_inline void enter_write(u32 fd, u64 buf, u32 iov) {
    u64 id = bpf_get_current_pid_tgid();
    if (!watching(id))
        return;
    u64 key = conn_key(id >> 32, fd);
    if (!inet.lookup(&key))
        return;
    struct pending p = {.buf = buf, .fd = fd, .iov = iov};
    writing.update(&id, &p);
}

static __always_inline void exit_write(void *ctx, s64 ret) {
    u64 id = bpf_get_current_pid_tgid();
    struct pending *p = writing.lookup(&id);
    if (!p)
        return;
    int zero = 0;
    struct event *e = scratch.lookup(&zero);
    if (!e) {
        writing.delete(&id);
        return;
    }
    e->kind = KIND_WRITE;
    e->pid = id >> 32;
    e->fd = p->fd;
    e->bytes = ret;
    e->captured = 0;
    e->drops = drops_so_far();
    u64 src = p->buf;
    u64 avail = ret > 0 ? ret : 0;
    if (p->iov && avail) {
        // sendmsg: the head of its first buffer (the others are counted, not captured)
        struct iovec first = {};
        if (bpf_probe_read_user(&first, sizeof(first), (void *)p->buf) != 0)
            avail = 0;
        src = (u64)first.iov_base;
        if (first.iov_len < avail)
            avail = first.iov_len;
    }
    if (avail >= HEAD) {
        if (bpf_probe_read_user(e->head, HEAD, (void *)src) == 0)
            e->captured = HEAD;
    } else if (avail) {
        u32 n = avail & (HEAD - 1);
        if (bpf_probe_read_user(e->head, n, (void *)src) == 0)
            e->captured = n;
    }
    dropped(events.ringbuf_output(e, sizeof(*e), 0));
    writing.delete(&id);
}

TRACEPOINT_PROBE(syscalls, sys_enter_write) {
    enter_write(args->fd, (u64)args->buf, 0);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) {
    exit_write(args, args->ret);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) {
    enter_write(args->fd, (u64)args->buff, 0);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) {
    exit_write(args, args->ret);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) {
    struct user_msghdr msg = {};
    if (bpf_probe_read_user(&msg, sizeof(msg), (void *)args->msg) != 0)
        return 0;
    enter_write(args->fd, (u64)msg.msg_iov, 1);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) {
    exit_write(args, args->ret);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_connect) {
    u64 id = bpf_get_current_pid_tgid();
    if (!watching(id))
        return 0;
    u16 family = 0;
    bpf_probe_read_user(&family, sizeof(family), (void *)args->uservaddr);
    if (family != AF_INET && family != AF_INET6)
        return 0;
    u32 fd = args->fd;
    connecting.update(&id, &fd);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_connect) {
    u64 id = bpf_get_current_pid_tgid();
    u32 *fd = connecting.lookup(&id);
    if (!fd)
        return 0;
    // -EINPROGRESS: a non-blocking connect, usable once it completes
    if (args->ret == 0 || args->ret == -115) {
        u64 key = conn_key(id >> 32, *fd);
        u8 one = 1;
        inet.update(&key, &one);
        announce(args, KIND_OPEN, id >> 32, *fd);
    }
    connecting.delete(&id);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_accept4) {
    u64 id = bpf_get_current_pid_tgid();
    if (!watching(id) || !args->upeer_sockaddr)
        return 0;
    u64 addr = (u64)args->upeer_sockaddr;
    accepting.update(&id, &addr);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_accept4) {
    u64 id = bpf_get_current_pid_tgid();
    u64 *addr = accepting.lookup(&id);
    if (!addr)
        return 0;
    u16 family = 0;
    // The kernel filled in the peer's address by now.
    if (args->ret >= 0 && bpf_probe_read_user(&family, sizeof(family), (void *)*addr) == 0 &&
        (family == AF_INET || family == AF_INET6)) {
        u64 key = conn_key(id >> 32, args->ret);
        u8 one = 1;
        inet.update(&key, &one);
        announce(args, KIND_OPEN, id >> 32, args->ret);
    }
    accepting.delete(&id);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_close) {
    u64 id = bpf_get_current_pid_tgid();
    u64 key = conn_key(id >> 32, args->fd);
    if (!inet.lookup(&key))
        return 0;
    inet.delete(&key);
    announce(args, KIND_CLOSE, id >> 32, args->fd);
    return 0;
}

// ------------------------------------------------------------------ CUDA copies (uprobes)

#define KIND_COPIES 4
#define KINDS 8  // cudaMemcpyKind: host-to-host, host-to-device, device-to-host, device-to-device, default
#define RUNTIME 1
#define DRIVER 2
// MAX_RUNS (witness.py: RUNS_KEPT) is a power of two: indices are masked with it for the verifier

struct label {
    char xfer[128];
    u64 bytes[KINDS];
    u64 calls;
    u64 failed;
    u64 failed_bytes;
    u64 rdma_bytes;      // of work requests posted (RDMA write, write with immediate, send, read)
    u64 rdma_wrs;
    u64 rdma_truncated;  // a post longer than the probe follows: the count is a lower bound
    u64 remote_lo;       // the remote memory the RDMA writes touched: [lo, hi), 0 when none
    u64 remote_hi;
    u64 first_write_ns;  // when the first and the last accepted post with RDMA writes began
    u64 last_write_ns;   // (CLOCK_MONOTONIC): no write of the transfer landed before the first
    u32 runs;            // the writes' remote ranges, adjacent ones merged, in posting order
    u32 runs_lost;       // writes beyond MAX_RUNS ranges: the runs are then a part of them
    u64 run_addr[MAX_RUNS];
    u64 run_len[MAX_RUNS];
};

struct copy_event {  // flat: bcc builds the user side's type from it
    u32 kind;
    u32 pid;
    char xfer[128];
    u64 bytes[KINDS];
    u64 calls;
    u64 failed;
    u64 failed_bytes;
    u64 rdma_bytes;
    u64 rdma_wrs;
    u64 rdma_truncated;
    u64 remote_lo;
    u64 remote_hi;
    u64 first_write_ns;
    u64 last_write_ns;
    u32 runs;
    u32 runs_lost;
    u64 run_addr[MAX_RUNS];
    u64 run_len[MAX_RUNS];
};

struct copy {
    u64 n;
    u32 kind;
    u32 level;  // RUNTIME or DRIVER: which probe's return settles it
};

BPF_HASH(labels, u64, struct label);  // tid -> the transfer it named, and its copies so far
BPF_HASH(copying, u64, struct copy);  // tid -> the copy call in progress
BPF_PERCPU_ARRAY(label_scratch, struct label, 1);
BPF_PERCPU_ARRAY(copy_scratch, struct copy_event, 1);
BPF_RINGBUF_OUTPUT(copies, 16);

int xfer_begin(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!watching(id))
        return 0;
    int zero = 0;
    struct label *l = label_scratch.lookup(&zero);
    if (!l)
        return 0;
    __builtin_memset(l, 0, offsetof(struct label, run_addr));  // the runs beyond l->runs are never read
    bpf_probe_read_user_str(l->xfer, sizeof(l->xfer), (void *)PT_REGS_PARM1(ctx));
    labels.update(&id, l);
    return 0;
}

int xfer_end(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct label *l = labels.lookup(&id);
    if (!l)
        return 0;
    int zero = 0;
    struct copy_event *e = copy_scratch.lookup(&zero);
    if (e) {
        e->kind = KIND_COPIES;
        e->pid = id >> 32;
        __builtin_memcpy(e->xfer, l->xfer, sizeof(e->xfer));
#pragma unroll
        for (int k = 0; k < KINDS; k++)
            e->bytes[k] = l->bytes[k];
        e->calls = l->calls;
        e->failed = l->failed;
        e->failed_bytes = l->failed_bytes;
        e->rdma_bytes = l->rdma_bytes;
        e->rdma_wrs = l->rdma_wrs;
        e->rdma_truncated = l->rdma_truncated;
        e->remote_lo = l->remote_lo;
        e->remote_hi = l->remote_hi;
        e->first_write_ns = l->first_write_ns;
        e->last_write_ns = l->last_write_ns;
        e->runs = l->runs;
        e->runs_lost = l->runs_lost;
        for (int i = 0; i < MAX_RUNS; i++) {
            e->run_addr[i] = l->run_addr[i];
            e->run_len[i] = l->run_len[i];
        }
        dropped(copies.ringbuf_output(e, sizeof(*e), 0));
    }
    labels.delete(&id);
    return 0;
}

static __always_inline int copy_enter(u64 n, u32 kind, u32 level) {
    u64 id = bpf_get_current_pid_tgid();
    if (!labels.lookup(&id) || copying.lookup(&id))
        return 0;  // no transfer named, or the driver call inside a runtime call
    struct copy c = {.n = n, .kind = kind & (KINDS - 1), .level = level};
    copying.update(&id, &c);
    return 0;
}

static __always_inline int copy_return(struct pt_regs *ctx, u32 level) {
    u64 id = bpf_get_current_pid_tgid();
    struct copy *c = copying.lookup(&id);
    if (!c || c->level != level)
        return 0;
    struct label *l = labels.lookup(&id);
    if (l) {
        l->calls++;
        if ((int)PT_REGS_RC(ctx) == 0) {
            u32 k = c->kind & (KINDS - 1);
            l->bytes[k] += c->n;
        } else {
            l->failed++;
            l->failed_bytes += c->n;
        }
    }
    copying.delete(&id);
    return 0;
}

// cudaMemcpy[Async](dst, src, count, kind[, stream])
int runtime_copy(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), RUNTIME); }
// cudaMemcpyPeer[Async](dst, dst_device, src, src_device, count[, stream])
int runtime_peer(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM5(ctx), 3, RUNTIME); }
int runtime_return(struct pt_regs *ctx) { return copy_return(ctx, RUNTIME); }
// cuMemcpy[Async](dst, src, count[, stream]), cuMemcpyDtoH/HtoD/DtoD[Async]_v2(dst, src, count[, stream])
int driver_default(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM3(ctx), 4, DRIVER); }
int driver_d2h(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM3(ctx), 2, DRIVER); }
int driver_h2d(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM3(ctx), 1, DRIVER); }
int driver_d2d(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM3(ctx), 3, DRIVER); }
// cuMemcpyPeer[Async](dst, dst_context, src, src_context, count[, stream])
int driver_peer(struct pt_regs *ctx) { return copy_enter(PT_REGS_PARM5(ctx), 3, DRIVER); }
int driver_return(struct pt_regs *ctx) { return copy_return(ctx, DRIVER); }

// ------------------------------------------------------------------ RDMA work requests (uprobes)
//
// ibv_post_send is a static inline of verbs.h: it calls qp->context->ops.post_send, the
// provider's function (libmlx5's is not even an exported symbol). So the witness learns its
// address where a context or queue pair passes through libibverbs' exported functions
// (ibv_open_device returns the context; ibv_create_qp returns, and ibv_modify_qp takes, a
// queue pair), and user space attaches rdma_post_send there. Offsets: rdma-core's verbs.h,
// a stable ABI (tests/cuda_hooks/test_witness.py compiles against the real header to check them).

#define POST_SEND_OFFSET 208  // offsetof(struct ibv_context, ops.post_send)
#define WR_NEXT 8
#define WR_SG_LIST 16
#define WR_NUM_SGE 24
#define WR_OPCODE 28
#define WR_REMOTE_ADDR 40  // wr.rdma.remote_addr
#define SGE_LENGTH 8
#define SGE_SIZE 16
#define DATA_OPCODES 4  // IBV_WR_RDMA_WRITE, _WITH_IMM, SEND, SEND_WITH_IMM, RDMA_READ: 0..4
#define WRITE_OPCODES 1  // IBV_WR_RDMA_WRITE, _WITH_IMM: 0..1, the ones that land in remote memory
#define MAX_WRS 32
#define MAX_SGES 8

struct provider_event {
    u32 kind;
    u32 pid;
    u64 address;  // of the provider's post_send in the process
};

struct post {
    u64 bytes;
    u64 wrs;
    u64 truncated;
    u64 remote_lo;
    u64 remote_hi;
    u64 wrote;  // RDMA writes among its work requests
    u64 at;     // when it was entered: no write of it can land before (the NIC starts within)
    // The label's runs before this post added to them: restored if the provider refuses it.
    u32 runs;
    u32 runs_lost;
    u64 last_len;
};

// One RDMA write's remote range joins the transfer's runs: it extends the last run when it
// starts where that one ends (a layer's consecutive pages), else starts a new one.
static __always_inline void add_run(struct label *l, u64 addr, u64 len) {
    u32 n = l->runs;
    u32 last = (n - 1) & (MAX_RUNS - 1);
    if (n && l->run_addr[last] + l->run_len[last] == addr) {
        l->run_len[last] += len;
    } else if (n < MAX_RUNS) {
        l->run_addr[n & (MAX_RUNS - 1)] = addr;
        l->run_len[n & (MAX_RUNS - 1)] = len;
        l->runs = n + 1;
    } else {
        l->runs_lost++;
    }
}

BPF_RINGBUF_OUTPUT(providers, 1);
BPF_HASH(posting, u64, struct post);  // tid -> the post in progress
BPF_PERCPU_ARRAY(unlabelled, u64, 1);  // posts of watched processes outside any named transfer

static __always_inline int tell_post_send(struct pt_regs *ctx, u64 context) {
    u64 id = bpf_get_current_pid_tgid();
    u64 fn = 0;
    if (!watching(id) || !context)
        return 0;
    if (bpf_probe_read_user(&fn, sizeof(fn), (void *)(context + POST_SEND_OFFSET)) != 0 || !fn)
        return 0;
    struct provider_event e = {.kind = KIND_COPIES + 1, .pid = id >> 32, .address = fn};
    dropped(providers.ringbuf_output(&e, sizeof(e), 0));
    return 0;
}

// uretprobe ibv_open_device: the context
int rdma_context(struct pt_regs *ctx) { return tell_post_send(ctx, PT_REGS_RC(ctx)); }

static __always_inline int tell_from_qp(struct pt_regs *ctx, u64 qp) {
    u64 context = 0;
    if (!qp || bpf_probe_read_user(&context, sizeof(context), (void *)qp) != 0)  // qp->context is first
        return 0;
    return tell_post_send(ctx, context);
}

// uretprobe ibv_create_qp: the queue pair; uprobe ibv_modify_qp(qp, ...)
int rdma_created_qp(struct pt_regs *ctx) { return tell_from_qp(ctx, PT_REGS_RC(ctx)); }
int rdma_modified_qp(struct pt_regs *ctx) { return tell_from_qp(ctx, PT_REGS_PARM1(ctx)); }

// the provider's post_send(qp, wr, bad_wr): the data its chain of work requests moves
int rdma_post_send(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct label *l = labels.lookup(&id);
    if (!l) {
        // A transfer engine that posts from its own threads: not attributable, but said.
        int zero = 0;
        u64 *n = unlabelled.lookup(&zero);
        if (n && watching(id))
            (*n)++;
        return 0;
    }
    struct post p = {.runs = l->runs, .runs_lost = l->runs_lost, .at = bpf_ktime_get_ns()};
    p.last_len = l->run_len[(p.runs - 1) & (MAX_RUNS - 1)];
    u64 wr = PT_REGS_PARM2(ctx);
    for (int i = 0; i < MAX_WRS && wr; i++) {
        u64 sg_list = 0;
        int num_sge = 0;
        u32 opcode = 0;
        bpf_probe_read_user(&sg_list, sizeof(sg_list), (void *)(wr + WR_SG_LIST));
        bpf_probe_read_user(&num_sge, sizeof(num_sge), (void *)(wr + WR_NUM_SGE));
        bpf_probe_read_user(&opcode, sizeof(opcode), (void *)(wr + WR_OPCODE));
        if (opcode <= DATA_OPCODES) {
            if (num_sge > MAX_SGES)
                p.truncated = 1;
            u64 bytes = 0;
            for (int j = 0; j < MAX_SGES && j < num_sge; j++) {
                u32 length = 0;
                bpf_probe_read_user(&length, sizeof(length), (void *)(sg_list + j * SGE_SIZE + SGE_LENGTH));
                bytes += length;
            }
            p.bytes += bytes;
            p.wrs++;
            u64 remote = 0;
            if (opcode <= WRITE_OPCODES && bytes &&
                bpf_probe_read_user(&remote, sizeof(remote), (void *)(wr + WR_REMOTE_ADDR)) == 0 && remote) {
                if (!p.remote_lo || remote < p.remote_lo)
                    p.remote_lo = remote;
                if (remote + bytes > p.remote_hi)
                    p.remote_hi = remote + bytes;
                add_run(l, remote, bytes);
                p.wrote = 1;
            }
        }
        if (bpf_probe_read_user(&wr, sizeof(wr), (void *)(wr + WR_NEXT)) != 0)
            wr = 0;
    }
    if (wr)
        p.truncated = 1;  // more work requests than the probe follows
    posting.update(&id, &p);
    return 0;
}

int rdma_post_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    struct post *p = posting.lookup(&id);
    if (!p)
        return 0;
    struct label *l = labels.lookup(&id);
    if (l && (int)PT_REGS_RC(ctx) == 0) {  // refused posts moved nothing
        l->rdma_bytes += p->bytes;
        l->rdma_wrs += p->wrs;
        l->rdma_truncated |= p->truncated;
        if (p->remote_lo && (!l->remote_lo || p->remote_lo < l->remote_lo))
            l->remote_lo = p->remote_lo;
        if (p->remote_hi > l->remote_hi)
            l->remote_hi = p->remote_hi;
        if (p->wrote) {
            if (!l->first_write_ns)
                l->first_write_ns = p->at;
            l->last_write_ns = p->at;
        }
    } else if (l && p->wrote) {  // the runs this post added never happened
        l->runs = p->runs;
        l->runs_lost = p->runs_lost;
        l->run_len[(p->runs - 1) & (MAX_RUNS - 1)] = p->last_len;
    }
    posting.delete(&id);
    return 0;
}
