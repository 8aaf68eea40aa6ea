/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * Capture of what a listener drops (`udp-fanout capture`): while a capture runs for a listener,
 * its userspace entry in FANOUT_MAP_CAPTURE_CONFIGS says which reasons and how many packets a
 * second; each dropped packet it takes is copied (from its IP header, at most `snaplen` bytes)
 * into a ring buffer the daemon reads and serves as pcapng. Without a capture the cost of a
 * drop is one array lookup; the forwarding path is not touched. The daemon's reader is
 * Sources/FanoutCore/Capture/KernelCaptureTap.swift.
 */
#ifndef FANOUT_CAPTURE_H
#define FANOUT_CAPTURE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_rate.h"

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, FANOUT_CAPTURE_RING_BYTES);
} FANOUT_MAP_CAPTURE SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_capture_config);
} FANOUT_MAP_CAPTURE_CONFIGS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, struct fanout_capture_stats);
} FANOUT_MAP_CAPTURE_STATS SEC(".maps");

/* Where an event is assembled (per CPU, off the stack) before bpf_ringbuf_output copies its used
 * length into the ring. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_capture_event);
} fanout_capbuf SEC(".maps");

static __always_inline long hook_load_bytes(FANOUT_CTX *ctx, __u32 offset, void *to, __u32 length);

/* `why` of fanout_capture_drop: the reason, and whether the packet is a reply (a BPF function
 * takes five arguments at most). */
#define FANOUT_CAPTURE_WHY(reason, reply) ((__u32)(reason) | ((reply) ? 0x100u : 0u))

/* Offers the packet listener `id` drops to its capture: `why` says the reason (a verdict or
 * FANOUT_CAPTURE_*) and whether it is a reply of a nat listener (FANOUT_CAPTURE_WHY). 1 when it
 * went into the ring. `length`: the packet's length as it arrived. Verified once (a global
 * function). */
__noinline int fanout_capture_drop(FANOUT_CTX *ctx, struct packet *p, __u32 id, __u32 why, __u32 length)
{
	__u32 reason = why & 0xff;
	__u32 reply = (why & 0x100) != 0;
	if (!ctx || !p || id >= FANOUT_MAX_LISTENERS || reason >= 64)
		return 0;
	struct fanout_capture_config *config = bpf_map_lookup_elem(&FANOUT_MAP_CAPTURE_CONFIGS, &id);
	if (!config || !config->snaplen)
		return 0;
	__u64 reasons = reply ? config->reply_reasons : config->forward_reasons;
	if (!(reasons & (1ULL << reason)))
		return 0;
	struct fanout_capture_stats *stats = bpf_map_lookup_elem(&FANOUT_MAP_CAPTURE_STATS, &id);
	if (!stats)
		return 0;
	if (!rate_charge(&config->tat, config->interval, config->tolerance, bpf_ktime_get_ns())) {
		stats->sampled_out++;
		return 0;
	}
	__u32 zero = 0;
	struct fanout_capture_event *event = bpf_map_lookup_elem(&fanout_capbuf, &zero);
	if (!event)
		return 0;
	__u32 l3 = p->l3;
	__u32 wire = length > l3 ? length - l3 : 0;
	__u32 take = wire < config->snaplen ? wire : config->snaplen;
	if (take > FANOUT_CAPTURE_DATA_MAX)
		take = FANOUT_CAPTURE_DATA_MAX;
	if (take < 1 || hook_load_bytes(ctx, l3, event->data, take) < 0)
		return 0;
	event->time = bpf_ktime_get_ns();
	event->listener_id = id;
	event->wire_length = wire;
	event->length = take;
	event->reason = reason;
	event->reply = reply != 0;
	event->family = p->family;
	__u64 size = __builtin_offsetof(struct fanout_capture_event, data) + take;
	if (bpf_ringbuf_output(&FANOUT_MAP_CAPTURE, event, size, 0) < 0) {
		stats->ring_full++;
		return 0;
	}
	stats->captured++;
	return 1;
}

#endif /* FANOUT_CAPTURE_H */
