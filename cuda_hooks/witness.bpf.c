// kvguard wire witness: what watched processes write to their TCP connections, seen from the
// kernel, with no change to the process. Compiled by bcc (cuda_hooks/witness.py), which passes
// HEAD (bytes of each write captured for the user-side decoder) as -DHEAD=...
//
// Invariant: only processes in `watched` are reported, and of their file descriptors only
// those that connect()ed to, or were accept()ed from, an IPv4/IPv6 peer; every such write
// is one event (its length as the kernel returned it, and its first HEAD bytes), every
// connect, accept and close of such a descriptor is one event, in the order the process
// made them. Nothing here blocks or changes the process.

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
    u8 head[HEAD];
};

BPF_HASH(watched, u32, u32);           // tgid -> 1
BPF_HASH(inet, u64, u8, 65536);        // (tgid << 32 | fd) -> 1: a TCP descriptor of a watched process
BPF_HASH(connecting, u64, u32);        // tid -> fd of a connect() to an inet address in progress
BPF_HASH(accepting, u64, u64);         // tid -> user address of the peer address an accept4() fills
BPF_HASH(writing, u64, struct pending);
BPF_PERCPU_ARRAY(scratch, struct event, 1);
BPF_PERF_OUTPUT(events);

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
    events.perf_submit(ctx, e, offsetof(struct event, head));
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
    events.perf_submit(ctx, e, sizeof(*e));
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
