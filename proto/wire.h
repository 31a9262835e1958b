/* kvguard.v1 events read from their bytes, in C: the protobuf wire format of the Event
 * envelope and of the payloads every request makes (alloc, write, free, read), and of a batch
 * of events (EventBatch, AgentMessage). Header only (static inline): each C module that reads
 * event bytes includes it (proto/_wire.c, ledger/_pages.c, daemon/_rows.c).
 *
 * Invariant: a head says only what protobuf would say of the same bytes. Anything unusual
 * (a field given twice, a wire type not its own, a value beyond its type, a length that runs
 * past the end, a varint not in its shortest form where a length is framed) makes the head
 * "not read here" (kind 0, or plain 0 for the payload), and the caller then asks protobuf.
 */
#ifndef KVGUARD_WIRE_H
#define KVGUARD_WIRE_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Payload field numbers of kvguard.v1.Event (events.proto). */
enum {
    WIRE_FIRST_PAYLOAD = 10,
    WIRE_ALLOC = 16,
    WIRE_WRITE = 17,
    WIRE_FREE = 18,
    WIRE_READ = 22,
    WIRE_STEP = 29,
    WIRE_LAST_PAYLOAD = 31 /* pool_memory */
};
#define WIRE_PAGES 3 /* `pages` in Alloc, Write, Free and ReadEntry */

/* One event as found in its bytes: the layout of proto/wire.py's HEAD (72 bytes). Offsets are
 * into the bytes the head was read from (an event, or the batch that holds it). */
typedef struct {
    uint8_t kind;   /* the payload's field number; 0: the envelope is not read here */
    uint8_t plain;  /* an alloc, a write, a free, a one-entry read, or a step whose fields are each
                       in their own shape: its fields are read (a step's: pool); 2: a write whose
                       slots are given (packed, field 4, once) */
    uint16_t batched; /* read from a batch: the event's field (tag, length) lies right before `start` */
    uint32_t start, end;           /* the event's bytes */
    uint32_t node_start, node_end; /* Event.node */
    uint32_t req_start, req_end;   /* plain: the payload's req */
    uint32_t pay_start, pay_end;   /* plain: the payload (of a read: its one entry), whose field 3 lists the pages */
    uint32_t pool;                 /* plain: the payload's pool */
    uint64_t seq;
    int64_t ts;
    uint64_t tokens; /* plain read: the entry's tokens */
    uint64_t epoch;  /* Event.epoch: the engine process's incarnation (0: none given) */
} WireHead;

_Static_assert(sizeof(WireHead) == 72, "a head is one cache line and the epoch");

typedef struct {
    const uint8_t *data;
    Py_ssize_t pos, end;
} WireReader;

/* A varint at *pos (< end); -1 if it runs past end or beyond 10 bytes. */
static inline int
wire_varint(const uint8_t *data, Py_ssize_t end, Py_ssize_t *pos, uint64_t *value)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && *pos < end; shift += 7) {
        uint8_t b = data[(*pos)++];
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *value = v;
            return 0;
        }
    }
    return -1;
}

/* The number of bytes of v as a varint in its shortest form. */
static inline Py_ssize_t
wire_varint_size(uint64_t v)
{
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Skips the rest of group `number` (its start read): fields up to its end-group tag, groups
 * within it too (at most 64 deep); -1 if the bytes end first or another group ends. */
static inline int
wire_skip_group(const uint8_t *data, Py_ssize_t len, Py_ssize_t *pos, uint64_t number, int depth)
{
    uint64_t key, value;
    if (depth >= 64)
        return -1;
    while (*pos < len) {
        if (wire_varint(data, len, pos, &key) < 0)
            return -1;
        switch (key & 7) {
        case 0:
            if (wire_varint(data, len, pos, &value) < 0)
                return -1;
            break;
        case 1:
            *pos += 8;
            break;
        case 2:
            if (wire_varint(data, len, pos, &value) < 0 || value > (uint64_t)(len - *pos))
                return -1;
            *pos += (Py_ssize_t)value;
            break;
        case 3:
            if (wire_skip_group(data, len, pos, key >> 3, depth + 1) < 0)
                return -1;
            break;
        case 4:
            return (key >> 3) == number ? 0 : -1;
        case 5:
            *pos += 4;
            break;
        default:
            return -1;
        }
        if (*pos > len)
            return -1;
    }
    return -1;
}

/* The values of varint field `field` (packed or not) in a serialized message data[0, len),
 * clamped to INT64_MAX: counted when out is NULL, else stored in out. -1 when the bytes are
 * not a message. */
static inline Py_ssize_t
wire_scan(const uint8_t *data, Py_ssize_t len, uint64_t field, int64_t *out)
{
    Py_ssize_t pos = 0, got = 0;
    uint64_t key, value, size;
    while (pos < len) {
        if (wire_varint(data, len, &pos, &key) < 0)
            return -1;
        int wire = (int)(key & 7);
        if ((key >> 3) == field && wire == 0) {
            if (wire_varint(data, len, &pos, &value) < 0)
                return -1;
            if (out != NULL)
                out[got] = value > INT64_MAX ? INT64_MAX : (int64_t)value;
            got++;
            continue;
        }
        switch (wire) {
        case 0:
            if (wire_varint(data, len, &pos, &value) < 0)
                return -1;
            break;
        case 1:
            pos += 8;
            break;
        case 2:
            if (wire_varint(data, len, &pos, &size) < 0 || size > (uint64_t)(len - pos))
                return -1;
            if ((key >> 3) == field) { /* packed */
                Py_ssize_t end = pos + (Py_ssize_t)size;
                while (pos < end) {
                    if (wire_varint(data, end, &pos, &value) < 0)
                        return -1;
                    if (out != NULL)
                        out[got] = value > INT64_MAX ? INT64_MAX : (int64_t)value;
                    got++;
                }
            } else {
                pos += (Py_ssize_t)size;
            }
            break;
        case 3: /* a group: protobuf keeps one it does not know (any field number, ours too) */
            if (wire_skip_group(data, len, &pos, key >> 3, 0) < 0)
                return -1;
            break;
        case 5:
            pos += 4;
            break;
        default:
            return -1;
        }
        if (pos > len)
            return -1;
    }
    return got;
}

/* The next field's number and wire type; 0 at the end, -1 when the bytes are not a message. */
static inline int
wire_next(WireReader *r, uint64_t *number, int *wire)
{
    uint64_t key;
    if (r->pos >= r->end)
        return 0;
    if (wire_varint(r->data, r->end, &r->pos, &key) < 0 || (key >> 3) == 0)
        return -1;
    *number = key >> 3;
    *wire = (int)(key & 7);
    return 1;
}

/* Skips a field's value of wire type `wire`; -1 when it runs past the end (or is a group). */
static inline int
wire_skip(WireReader *r, int wire)
{
    uint64_t value;
    switch (wire) {
    case 0:
        return wire_varint(r->data, r->end, &r->pos, &value);
    case 1:
        r->pos += 8;
        break;
    case 2:
        if (wire_varint(r->data, r->end, &r->pos, &value) < 0 || value > (uint64_t)(r->end - r->pos))
            return -1;
        r->pos += (Py_ssize_t)value;
        break;
    case 5:
        r->pos += 4;
        break;
    default:
        return -1;
    }
    return r->pos <= r->end ? 0 : -1;
}

/* A length-delimited value: its bytes [*start, *end); -1 when it runs past the end, or, with
 * `shortest`, when its length is not in its shortest form (the bytes of a batch are kept as
 * they are, so they must be what protobuf would write). */
static inline int
wire_span(WireReader *r, Py_ssize_t *start, Py_ssize_t *end, int shortest)
{
    uint64_t size;
    Py_ssize_t at = r->pos;
    if (wire_varint(r->data, r->end, &r->pos, &size) < 0 || size > (uint64_t)(r->end - r->pos))
        return -1;
    if (shortest && r->pos - at != wire_varint_size(size))
        return -1;
    *start = r->pos;
    r->pos += (Py_ssize_t)size;
    *end = r->pos;
    return 0;
}

/* The fields of an alloc, write or free payload, or of a read's entry (tokens: field 4), in
 * [r.pos, r.end): req (1), pool (2), pages (3), a write's slots (4, packed, once: h->plain
 * becomes 2); 0 if plain, -1 if anything else is there (a field twice, a wire type not its
 * own, a pool beyond uint32). */
static inline int
wire_payload(WireReader r, int kind, WireHead *h)
{
    uint64_t number, value;
    Py_ssize_t a, b;
    int wire, got, seen = 0;
    while ((got = wire_next(&r, &number, &wire)) > 0) {
        if (number == 1 && wire == 2 && !(seen & 1)) {
            if (wire_span(&r, &a, &b, 0) < 0)
                return -1;
            h->req_start = (uint32_t)a;
            h->req_end = (uint32_t)b;
            seen |= 1;
        } else if (number == 2 && wire == 0 && !(seen & 2)) {
            if (wire_varint(r.data, r.end, &r.pos, &value) < 0 || value > UINT32_MAX)
                return -1;
            h->pool = (uint32_t)value;
            seen |= 2;
        } else if (number == WIRE_PAGES && (wire == 0 || wire == 2)) {
            if (wire_skip(&r, wire) < 0)
                return -1;
        } else if (number == 4 && kind == WIRE_READ && wire == 0 && !(seen & 4)) {
            if (wire_varint(r.data, r.end, &r.pos, &h->tokens) < 0)
                return -1;
            seen |= 4;
        } else if (number == 4 && kind == WIRE_WRITE && wire == 2 && !(seen & 4)) {
            if (wire_skip(&r, wire) < 0)
                return -1;
            seen |= 4;
            h->plain = 2;
        } else if (number <= 4) { /* a known field twice, a wire type not its own */
            return -1;
        } else if (wire_skip(&r, wire) < 0) {
            return -1;
        }
    }
    return got;
}

/* A step's payload in [start, end): its pool (1) read into h; the requests (2, strings), counts
 * (3), pages (4), slots (5), handles (6) and grants (7) each in its own wire type, the packed ones
 * given at most once (as protobuf writes them); 0 if so, -1 if anything else is there. */
static inline int
wire_step(const uint8_t *data, Py_ssize_t start, Py_ssize_t end, WireHead *h)
{
    WireReader r = {data, start, end};
    uint64_t number, value;
    int wire, got, seen = 0;
    while ((got = wire_next(&r, &number, &wire)) > 0) {
        if (number == 1 && wire == 0 && !(seen & 1)) {
            if (wire_varint(r.data, r.end, &r.pos, &value) < 0 || value > UINT32_MAX)
                return -1;
            h->pool = (uint32_t)value;
            seen |= 1;
        } else if (number == 2 && wire == 2) {
            if (wire_skip(&r, wire) < 0)
                return -1;
        } else if (number >= 3 && number <= 7 && wire == 2 && !(seen & (1 << number))) {
            if (wire_skip(&r, wire) < 0)
                return -1;
            seen |= 1 << number;
        } else if (number <= 7 || wire_skip(&r, wire) < 0) {
            return -1;
        }
    }
    return got;
}

/* The head of the event at data[start, end): its envelope (node, seq, ts and exactly one
 * payload: kind) and, for the plain shape of the events every request makes (an alloc, a
 * write (plain 2 with slots), a free, a read of one entry), its payload's fields (plain). Unusual
 * bytes leave kind 0: protobuf decides what they are. */
static inline void
wire_head(const uint8_t *data, Py_ssize_t start, Py_ssize_t end, WireHead *h)
{
    WireReader r = {data, start, end};
    uint64_t number;
    Py_ssize_t a, b, pay_start = 0, pay_end = 0;
    int wire, got, seen = 0, kind = 0;
    memset(h, 0, sizeof(*h));
    h->start = (uint32_t)start;
    h->end = (uint32_t)end;
    while ((got = wire_next(&r, &number, &wire)) > 0) {
        if (number == 1 && wire == 2 && !(seen & 1)) {
            if (wire_span(&r, &a, &b, 0) < 0)
                return;
            h->node_start = (uint32_t)a;
            h->node_end = (uint32_t)b;
            seen |= 1;
        } else if (number == 2 && wire == 0 && !(seen & 2)) {
            if (wire_varint(r.data, r.end, &r.pos, &h->seq) < 0)
                return;
            seen |= 2;
        } else if (number == 3 && wire == 0 && !(seen & 4)) {
            uint64_t ts;
            if (wire_varint(r.data, r.end, &r.pos, &ts) < 0)
                return;
            h->ts = (int64_t)ts;
            seen |= 4;
        } else if (number == 4 && wire == 0 && !(seen & 8)) {
            if (wire_varint(r.data, r.end, &r.pos, &h->epoch) < 0)
                return;
            seen |= 8;
        } else if (number >= WIRE_FIRST_PAYLOAD && number <= WIRE_LAST_PAYLOAD && wire == 2 && !kind) {
            if (wire_span(&r, &pay_start, &pay_end, 0) < 0)
                return;
            kind = (int)number;
        } else if (number <= 4 || (number >= WIRE_FIRST_PAYLOAD && number <= WIRE_LAST_PAYLOAD)) {
            return; /* a field twice, a wire type not its own, a second payload */
        } else if (wire_skip(&r, wire) < 0) {
            return;
        }
    }
    if (got < 0 || !kind)
        return;
    h->kind = (uint8_t)kind;
    if (kind == WIRE_STEP) {
        if (wire_step(data, pay_start, pay_end, h) == 0) {
            h->pay_start = (uint32_t)pay_start;
            h->pay_end = (uint32_t)pay_end;
            h->plain = 1;
        }
        return;
    }
    if (kind != WIRE_ALLOC && kind != WIRE_WRITE && kind != WIRE_FREE && kind != WIRE_READ)
        return;
    if (kind == WIRE_READ) { /* Read: exactly one entry (field 1) */
        WireReader entries = {data, pay_start, pay_end};
        int n = 0;
        while ((got = wire_next(&entries, &number, &wire)) > 0) {
            if (number == 1 && wire == 2) {
                if (n++ || wire_span(&entries, &pay_start, &pay_end, 0) < 0)
                    return;
            } else if (number == 1 || wire_skip(&entries, wire) < 0) {
                return;
            }
        }
        if (got < 0 || n != 1)
            return;
    }
    WireReader fields = {data, pay_start, pay_end};
    if (wire_payload(fields, kind, h) < 0) {
        h->plain = 0;
        return;
    }
    h->pay_start = (uint32_t)pay_start;
    h->pay_end = (uint32_t)pay_end;
    if (!h->plain)
        h->plain = 1;
}

/* The heads of a batch's events: data[0, len) is an EventBatch (events: field 1), or, with
 * `wrapped`, an AgentMessage whose one field is its batch (field 2). Returns the number of
 * events (heads written to out, which has room for `room`; counted only when out is NULL),
 * or -1 when the bytes are anything else: another field, a field twice, a length not in its
 * shortest form, more events than `room`. A batch is at most 4 GiB (offsets are 32-bit). */
static inline Py_ssize_t
wire_batch(const uint8_t *data, Py_ssize_t len, int wrapped, WireHead *out, Py_ssize_t room)
{
    uint64_t number;
    int wire, got;
    Py_ssize_t start = 0, end = len, a, b, n = 0;
    if (len > (Py_ssize_t)UINT32_MAX)
        return -1;
    if (wrapped) {
        WireReader m = {data, 0, len};
        int batches = 0;
        while ((got = wire_next(&m, &number, &wire)) > 0) {
            if (number != 2 || wire != 2 || batches++ || wire_span(&m, &start, &end, 1) < 0)
                return -1;
        }
        if (got < 0 || !batches)
            return -1;
    }
    WireReader r = {data, start, end};
    while (1) {
        Py_ssize_t frame = r.pos;
        got = wire_next(&r, &number, &wire);
        if (got == 0)
            break;
        if (got < 0 || number != 1 || wire != 2 || r.pos - frame != 1 || wire_span(&r, &a, &b, 1) < 0)
            return -1; /* the events' field, its tag and length in their shortest form, and nothing else */
        if (out != NULL) {
            if (n >= room)
                return -1;
            wire_head(data, a, b, &out[n]);
            out[n].batched = 1;
        }
        n++;
    }
    return n;
}

/* Where a batched event's field begins: its tag (one byte) and its length, shortest form. */
static inline uint32_t
wire_frame(const WireHead *h)
{
    return h->start - 1 - (uint32_t)wire_varint_size(h->end - h->start);
}

#endif
