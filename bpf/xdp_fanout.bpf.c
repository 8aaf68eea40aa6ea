// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * XDP program of udp-fanout's xdp mode: the tc_ebpf listener's behaviour at the driver, before
 * the kernel builds a socket buffer. Loaded with the tc program's maps (the Swift side hands it
 * their descriptors), so listeners, backend sets, round-robin positions, source tables, remembered
 * fragments, associations and counters are one set for both programs; the tc program is attached
 * at the same interfaces and finishes what this one passes.
 *
 * For a datagram of a listener this program serves (FANOUT_MAP_XFWD_IDS), in the tc program's
 * order and with its verdicts (the decision is bpf/include/fanout_decide.h, which the tc
 * program compiles too; this file holds the XDP hook's part): choose the backend (fanout_choice.h; a nat client keeps its
 * association), TTL / hop limit, the route (bpf_fib_lookup, MTU checked), pop one VLAN tag,
 * rewrite destination (reply: source) with incremental checksums (a zero IPv4 UDP checksum stays
 * zero), the fib's MACs, then XDP_TX when the route leaves through the arrival interface, or
 * bpf_redirect_map into FANOUT_MAP_XFWD_DEVICES; either only where that interface is in the map
 * (userspace puts there the interfaces whose driver transmits XDP frames). A nat listener's replies (fanout_nat.h) the same
 * way, from the listener's address.
 *
 * Passed on to the stack, untouched, for the tc program to finish (counted by reason in
 * FANOUT_MAP_XFWD_PASSED; tc then counts the datagram's verdict): a next hop the fib has no
 * Ethernet address for (tc resolves it), over the route's MTU (tc drops it too_large), a later
 * fragment whose first fragment did not leave here, a listener with replication pools (tc clones
 * the copies), a route through an interface that cannot transmit XDP frames, a UDP checksum left
 * for offload (CHECKSUM_PARTIAL: only tc knows the skb's checksum state). Passed uncounted:
 * everything that is not a datagram of a listener served here (tc counts it as its own or
 * unmatched; a later fragment XDP cannot follow is counted `fragment` here too, under its
 * listener when known). Dropped and counted with the tc program's verdicts: no backend, TTL
 * expired, no route, wrong server, drained, and a rewrite the frame's bounds refuse (a dropped
 * first fragment is remembered with its verdict: tc drops its later fragments the same way).
 * A datagram passed after its backend was chosen puts the listener's rotation back, so tc
 * chooses the same backend, and gives its source's rate_limit charge back, so tc charges it once.
 *
 * Here: how the frame is read (no pull: a frame is linear), what is passed to tc (hook_admit,
 * hook_follow, hook_can_send), and the way out (adjust_head for the tag, rewrite_frame's checksum
 * updates in the frame, XDP_TX or the device map's redirect).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "fanout_shared.h"
#include "parse.h"
#include "csum.h"
#include "fanout_maps.h"   /* the tc program's maps (their descriptors reused at load) */
#include "fanout_choice.h"    /* listener, backend (rotation, source table, association), fragment key */
#include "fanout_nat.h"       /* the reply direction of nat listeners */
#include "fanout_redirect.h"  /* route_request, route_forward (the next-hop cache) */


/* VLAN tags accepted in the frame: one, popped before the redirect (as the tc program). */
#define FANOUT_XFWD_VLAN_TAGS 1

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS);
	__type(key, __u32);
	__type(value, __u32);
} FANOUT_MAP_XFWD_IDS SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__uint(max_entries, FANOUT_XFWD_DEVICES);
	__type(key, __u32);
	__type(value, __u32);
} FANOUT_MAP_XFWD_DEVICES SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS + 1);
	__type(key, __u32);
	__type(value, struct fanout_xfwd_passed);
} FANOUT_MAP_XFWD_PASSED SEC(".maps");

/* A first fragment's decision on its way to FANOUT_MAP_FRAGMENTS: per CPU (XDP runs to its end
 * on one), off the 512-byte stack that the decision fills. Only the xdp program's: userspace
 * never reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_fragment);
} fanout_xrecord SEC(".maps");

/* Passes the datagram on to the stack (and the tc program), counted with its reason. */
static __always_inline int pass(__u32 id, __u32 reason)
{
	__u32 key = id < FANOUT_MAX_LISTENERS ? id : FANOUT_UNMATCHED_STATS;
	struct fanout_xfwd_passed *passed = bpf_map_lookup_elem(&FANOUT_MAP_XFWD_PASSED, &key);
	if (passed && reason < FANOUT_XFWD_PASS_COUNT)
		passed->reasons[reason]++;
	return XDP_PASS;
}

/* Whether listener `id` is served here (an xdp listener), not by the tc program alone. */
static __always_inline int served(__u32 id)
{
	__u32 *flag = bpf_map_lookup_elem(&FANOUT_MAP_XFWD_IDS, &id);
	return flag && *flag;
}

/* Whether the UDP checksum holds only the pseudo-header's sum, as a sender that offloads it
 * leaves it (CHECKSUM_PARTIAL, seen at a veth or in generic mode): the folded sum of source,
 * destination, protocol and UDP length as they lie in the packet. A finished checksum equals it
 * by chance once in 65535 datagrams; such a datagram goes through tc too, which is correct. */
static __always_inline int checksum_partial(void *data, void *end, struct packet *p)
{
	__u8 *udp = data + p->l4;
	if (!p->has_udp || p->l4 > 512 || (void *)(udp + 8) > end)
		return 0;
	__u16 check = *(__u16 *)(udp + 6);
	if (check == 0)
		return 0;
	__u64 sum = bpf_htons(IPPROTO_UDP) + *(__u16 *)(udp + 4);
	int words = p->family == AF_INET ? 1 : 4;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		if (i >= words)
			break;
		sum += (p->saddr[i] & 0xffff) + (p->saddr[i] >> 16) + (p->daddr[i] & 0xffff) + (p->daddr[i] >> 16);
	}
	return csum_fold64(sum) == check;
}

/* Writes the new destination (reply: source) address and port, decrements TTL / hop limit, and
 * updates the IPv4 header and UDP checksums incrementally, all in the frame. A UDP checksum of
 * zero (none) stays zero, as tc's bpf_l4_csum_replace leaves it (BPF_F_MARK_MANGLED_0), and a
 * computed zero is sent as 0xffff (RFC 768). */
static __always_inline int rewrite_frame(void *data, void *end, struct packet *p, struct fanout_backend *to, int reply)
{
	__u32 l3 = p->l3, l4 = p->l4;
	if (l3 > 18 || l4 > 512)
		return -1;
	__u8 *udp = data + l4;
	int udp_here = 0;
	if (p->has_udp) {
		if ((void *)(udp + 8) > end)
			return -1;
		udp_here = 1;
	}
	__u16 old_port = reply ? p->sport : p->dport;
	__u16 check = udp_here ? *(__u16 *)(udp + 6) : 0;
	int summed = check != 0;
	if (p->family == AF_INET) {
		__u8 *ip = data + l3;
		if ((void *)(ip + 20) > end)
			return -1;
		__u32 at = reply ? 12 : 16;
		__u32 old = *(__u32 *)(ip + at);
		__u16 header = *(__u16 *)(ip + 10);
		__u16 old_word = *(__u16 *)(ip + 8);
		ip[8] -= 1;
		header = csum_update16(header, old_word, *(__u16 *)(ip + 8));
		*(__u16 *)(ip + 10) = csum_update32(header, old, to->addr[0]);
		*(__u32 *)(ip + at) = to->addr[0];
		if (summed)
			check = csum_update32(check, old, to->addr[0]);
	} else {
		__u8 *ip = data + l3;
		if ((void *)(ip + 40) > end)
			return -1;
		ip[7] -= 1;
		__u32 *address = (__u32 *)(ip + (reply ? 8 : 24));
		if (summed) {
#pragma unroll
			for (int i = 0; i < 4; i++)
				check = csum_update32(check, address[i], to->addr[i]);
		}
		__builtin_memcpy(address, to->addr, 16);
	}
	if (udp_here && to->port != old_port) {
		if (summed)
			check = csum_update16(check, old_port, to->port);
		*(__u16 *)(udp + (reply ? 0 : 2)) = to->port;
	}
	if (summed)
		*(__u16 *)(udp + 6) = check ? check : 0xffff;
	return 0;
}

/* The xdp hook's part of the decision (fanout_decide.h): the listener's per-CPU rotation and
 * its position before the choice (a datagram passed to tc after the choice puts it back, so tc's
 * own choice is this one and the rotation moves once per datagram: on this CPU, the stack runs
 * tc where XDP ran). */
struct fanout_hook {
	__u32 *rotation;
	__u32 position;
};

#define FANOUT_CTX struct xdp_md
#define FANOUT_ACT_DROP XDP_DROP
#include "fanout_decide.h"   /* the decision, in the tc program's order */

/* flow_templates (fanout_templates.h): the frame's bytes (its fragments too, multi-buffer). */
static __always_inline long hook_load_bytes(struct xdp_md *ctx, __u32 offset, void *to, __u32 length)
{
	return bpf_xdp_load_bytes(ctx, offset, to, length);
}

/* Passes a datagram whose backend was chosen here: the rotation goes back to where it was, so
 * tc chooses the same backend (and moves it once). A new association keeps the choice itself:
 * tc finds it, chooses nothing, and the rotation stays moved once. */
static __always_inline int pass_chosen(struct fanout_decision *c, __u32 reason)
{
	if (c->hook.rotation && c->event == ASSOCIATION_KEPT)
		*c->hook.rotation = c->hook.position;
	/* rate_limit: tc charges the source's buckets for it. */
	if (c->rate)
		fanout_rate_refund();
	return pass(c->id, reason);
}

/* Not IP/UDP, malformed: the tc program counts it (not_ours, malformed). */
static __always_inline int hook_parse(struct fanout_decision *c)
{
	void *data = (void *)(long)c->ctx->data;
	void *end = (void *)(long)c->ctx->data_end;
	if (parse_frame(data, end, c->length, FANOUT_XFWD_VLAN_TAGS, &c->p) != PARSED_OK)
		return XDP_PASS;
	return FANOUT_GO_ON;
}

/* Passed uncounted: tc counts it. */
static __always_inline int hook_not_ours(struct fanout_decision *c)
{
	return XDP_PASS;
}

/* Only the datagrams of a listener served here, without pools (tc clones the copies), whose
 * checksum is finished; before the choice, which has effects (rotation, association). */
static __always_inline int hook_admit(struct fanout_decision *c, struct fanout_listener *listener)
{
	if (!served(c->id))
		return XDP_PASS; /* a tc_ebpf listener on this interface */
	if (listener && listener->pool_count)
		return pass(c->id, FANOUT_XFWD_PASS_POOLS);
	void *data = (void *)(long)c->ctx->data;
	void *end = (void *)(long)c->ctx->data_end;
	if (checksum_partial(data, end, &c->p))
		return pass(c->id, FANOUT_XFWD_PASS_CHECKSUM_PARTIAL);
	if (listener) {
		c->hook.rotation = bpf_map_lookup_elem(&FANOUT_MAP_RR, &c->id);
		if (c->hook.rotation)
			c->hook.position = *c->hook.rotation;
	}
	return FANOUT_GO_ON;
}

static __always_inline void hook_chosen(struct fanout_decision *c, struct fanout_listener *listener)
{
}

static __always_inline int hook_untracked(struct fanout_decision *c)
{
	return pass(FANOUT_UNMATCHED_STATS, FANOUT_XFWD_PASS_FRAGMENT);
}

/* Only a fragment whose first left here: tc follows every other. */
static __always_inline int hook_follow(struct fanout_decision *c, struct fanout_fragment *remembered)
{
	if (!served(c->id) || remembered->pool_count || remembered->own_verdict != FANOUT_VERDICT_FORWARDED)
		return pass(c->id, FANOUT_XFWD_PASS_FRAGMENT);
	return FANOUT_GO_ON;
}

/* Nothing leaves ahead of the datagram (pools are tc's). */
static __always_inline int hook_ahead(struct fanout_decision *c)
{
	return 0;
}

/* On the stack: the xdp program has no callbacks to leave room for. */
static __always_inline struct bpf_fib_lookup *hook_fib(struct fanout_decision *c, struct bpf_fib_lookup *on_stack)
{
	__builtin_memset(on_stack, 0, sizeof(*on_stack));
	return on_stack;
}

static __always_inline long hook_route(struct fanout_decision *c, struct bpf_fib_lookup *fib)
{
	if (!c->reply)
		return route_forward(c->ctx, &c->p, &c->backend, c->id, c->ifindex, c->p.tot_len, fib);
	route_request(&c->p, &c->backend, c->reply, c->ifindex, c->p.tot_len, fib);
	return bpf_fib_lookup(c->ctx, fib, sizeof(*fib), 0);
}

/* tc finishes what needs the kernel's neighbour resolution or its too_large drop, and what
 * leaves through an interface that does not transmit XDP frames (the arrival one too: a veth's
 * XDP_TX needs its peer's XDP or GRO as much as a redirect does). */
static __always_inline int hook_can_send(struct fanout_decision *c, __u32 verdict, struct bpf_fib_lookup *fib)
{
	if (verdict == FANOUT_VERDICT_FORWARDED_NEIGH)
		return pass_chosen(c, FANOUT_XFWD_PASS_NO_NEIGHBOUR);
	if (verdict == FANOUT_VERDICT_TOO_LARGE)
		return pass_chosen(c, FANOUT_XFWD_PASS_TOO_LARGE);
	if (verdict == FANOUT_VERDICT_FORWARDED) {
		__u32 egress = fib->ifindex;
		if (!bpf_map_lookup_elem(&FANOUT_MAP_XFWD_DEVICES, &egress))
			return pass_chosen(c, FANOUT_XFWD_PASS_NO_XDP_XMIT);
	}
	return FANOUT_GO_ON;
}

/* The per-CPU record (its pools stay none: pools are tc's). */
static __always_inline struct fanout_fragment *hook_fragment_record(struct fanout_decision *c)
{
	__u32 key = 0;
	return bpf_map_lookup_elem(&fanout_xrecord, &key);
}

/* The ingress link's tag off, the rewrite in the frame, the fib's MACs, then XDP_TX when the
 * route leaves through the arrival interface, else the device map's redirect. */
static __always_inline long hook_send(struct fanout_decision *c, __u32 verdict, struct bpf_fib_lookup *fib)
{
	struct xdp_md *ctx = c->ctx;
	struct packet *p = &c->p;
	int transmit = fib->ifindex == c->ifindex;
	/* The frame starts 4 bytes later, its Ethernet header written below over the tag's end,
	 * where the encapsulated protocol already lies in place. */
	if (p->tagged) {
		if (bpf_xdp_adjust_head(ctx, 4))
			return -1;
		p->l3 -= 4;
		p->l4 -= 4;
	}
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	if (rewrite_frame(data, end, p, &c->backend, c->reply) < 0)
		return -1;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return -1;
	__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	long action = transmit ? XDP_TX : bpf_redirect_map(&FANOUT_MAP_XFWD_DEVICES, fib->ifindex, 0);
	return action == XDP_TX || action == XDP_REDIRECT ? action : -1;
}

static __always_inline __u32 hook_sent_length(struct fanout_decision *c)
{
	return c->ctx->data_end - c->ctx->data;
}

static __always_inline __u32 hook_current_length(struct xdp_md *ctx)
{
	return ctx->data_end - ctx->data;
}

/* The pools' copies are tc's (XDP passes such datagrams on): nothing is rewritten before. */
static __always_inline int hook_rewritten(struct fanout_decision *c)
{
	return 0;
}

SEC("xdp")
int FANOUT_PROG_XFWD(struct xdp_md *ctx)
{
	return fanout_decide(ctx, ctx->ingress_ifindex, ctx->data_end - ctx->data);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
