/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * settings.flow_templates in the kernel kinds (tc_ebpf, xdp): the program recognises the NetFlow
 * v9 and IPFIX datagrams that carry a template or options template set (v9 set IDs 0 and 1,
 * IPFIX 2 and 3) and passes a copy of each to the daemon through a ring buffer; the datagram is
 * forwarded as any other, so its own collector gets it in order. The daemon keeps each
 * exporter's templates, copies them to every downstream of the listener, and sends them to a
 * downstream before the set that makes it an exporter's new one is in force (docs/flow-templates.md).
 * A datagram of data alone costs the walk over at most FANOUT_TEMPLATE_SETS_MAX set headers.
 *
 * Each program defines, after including fanout_decide.h (which includes this header),
 *   hook_load_bytes(ctx, offset, to, length)  bpf_skb_load_bytes / bpf_xdp_load_bytes
 * with offsets from the start of the frame, as struct packet's.
 */
#ifndef FANOUT_TEMPLATES_H
#define FANOUT_TEMPLATES_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"

#ifndef FANOUT_CTX
#error "define FANOUT_CTX before including fanout_templates.h"
#endif

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, FANOUT_TEMPLATE_RING_BYTES);
} FANOUT_MAP_TEMPLATES SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_template_stats);
} FANOUT_MAP_TEMPLATE_STATS SEC(".maps");

/* Where an event is assembled (per CPU, off the stack) before bpf_ringbuf_output copies its
 * used length into the ring: a ring of FANOUT_TEMPLATE_RING_BYTES then holds thousands of
 * template datagrams, not FANOUT_TEMPLATE_RING_BYTES / sizeof(struct fanout_template_event). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_template_event);
} fanout_tplbuf SEC(".maps");

static __always_inline long hook_load_bytes(FANOUT_CTX *ctx, __u32 offset, void *to, __u32 length);

static __always_inline __u32 be16_at(const __u8 *bytes)
{
	return ((__u32)bytes[0] << 8) | bytes[1];
}

/* Passes the datagram to the daemon when it is NetFlow v9 or IPFIX with a template or options
 * template set; returns 1 when it did. Verified once (a global function). */
__noinline int fanout_capture_templates(FANOUT_CTX *ctx, struct packet *p, __u32 id)
{
	if (!ctx || !p || id >= FANOUT_MAX_LISTENERS || !p->has_udp)
		return 0;
	__u8 head[4] = {};
	__u32 udp = p->l4;
	if (hook_load_bytes(ctx, udp + 4, head, 2) < 0)
		return 0;
	__u32 udp_length = be16_at(head);
	__u32 start = udp + 8;
	if (udp_length < 8 + 16 || hook_load_bytes(ctx, start, head, 4) < 0)
		return 0;
	__u32 version = be16_at(head);
	if (version != 9 && version != 10)
		return 0;
	struct fanout_template_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_TEMPLATE_STATS, &id);
	if (!stats)
		return 0;
	if (p->fragment) {
		/* The sets lie in later fragments too: nothing to read whole here. */
		stats->fragmented++;
		return 0;
	}
	__u32 end = start + udp_length - 8;
	if (version == 10) {
		__u32 message = be16_at(head + 2);
		if (message < 16)
			return 0;
		if (start + message < end)
			end = start + message;
	}
	__u32 template_set = version == 9 ? 0 : 2;
	__u32 offset = start + (version == 9 ? 20 : 16);
	int found = 0;
	int i;
	for (i = 0; i < FANOUT_TEMPLATE_SETS_MAX; i++) {
		if (offset + 4 > end || offset > 0xffff)
			break;
		if (hook_load_bytes(ctx, offset, head, 4) < 0)
			break;
		__u32 set = be16_at(head);
		__u32 length = be16_at(head + 2);
		if (set == template_set || set == template_set + 1) {
			found = 1;
			break;
		}
		if (length < 4)
			break;
		offset += length;
	}
	if (!found) {
		/* More sets follow the ones looked at: a template set among them goes unseen. */
		if (i == FANOUT_TEMPLATE_SETS_MAX && offset + 4 <= end)
			stats->sets_unread++;
		return 0;
	}
	__u32 length = udp_length - 8;
	if (length > FANOUT_TEMPLATE_DATA_MAX) {
		stats->too_large++;
		return 0;
	}
	__u32 zero = 0;
	struct fanout_template_event *event = bpf_map_lookup_elem(&fanout_tplbuf, &zero);
	if (!event)
		return 0;
	event->listener_id = id;
	event->length = length;
	__builtin_memcpy(event->saddr, p->saddr, sizeof(event->saddr));
	event->sport = p->sport;
	event->family = p->family;
	event->reserved = 0;
	event->reserved2 = 0;
	if (length < 1 || length > FANOUT_TEMPLATE_DATA_MAX || hook_load_bytes(ctx, start, event->data, length) < 0)
		return 0;
	__u64 size = __builtin_offsetof(struct fanout_template_event, data) + length;
	if (bpf_ringbuf_output(&FANOUT_MAP_TEMPLATES, event, size, 0) < 0) {
		stats->ring_full++;
		return 0;
	}
	stats->captured++;
	return 1;
}

#endif /* FANOUT_TEMPLATES_H */
