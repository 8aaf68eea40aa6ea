// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * XDP program of udp-fanout's xdp mode: the tc_ebpf listener's behaviour at the driver, before
 * the kernel builds a socket buffer. Loaded with the tc program's maps (the Swift side hands it
 * their descriptors), so listeners, backend sets, round-robin positions, source tables, remembered
 * fragments, associations and counters are one set for both programs; the tc program is attached
 * at the same interfaces and finishes what this one passes.
 *
 * For a datagram of a listener this program serves (FANOUT_MAP_XFWD_IDS), in the tc program's
 * order and with its verdicts: choose the backend (fanout_choice.h; a nat client keeps its
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
 * chooses the same backend.
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
#include "fanout_redirect.h"  /* route_request */

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

/* Passes the datagram on to the stack (and the tc program), counted with its reason. */
static __always_inline int pass(__u32 id, __u32 reason)
{
	__u32 key = id < FANOUT_MAX_LISTENERS ? id : FANOUT_UNMATCHED_STATS;
	struct fanout_xfwd_passed *passed = bpf_map_lookup_elem(&FANOUT_MAP_XFWD_PASSED, &key);
	if (passed && reason < FANOUT_XFWD_PASS_COUNT)
		passed->reasons[reason]++;
	return XDP_PASS;
}

/* Passes a datagram whose backend was chosen here: the rotation goes back to where it was, so
 * tc chooses the same backend (and moves it once). A new association keeps the choice itself:
 * tc finds it, chooses nothing, and the rotation stays moved once. */
static __always_inline int pass_chosen(__u32 id, __u32 reason, __u32 *rotation, __u32 position, __u32 event)
{
	if (rotation && event == ASSOCIATION_KEPT)
		*rotation = position;
	return pass(id, reason);
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

SEC("xdp")
int FANOUT_PROG_XFWD(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u32 length = end - data;
	__u32 ifindex = ctx->ingress_ifindex;
	struct packet p = {};
	/* Not IP/UDP, malformed: the tc program counts it (not_ours, malformed). */
	if (parse_frame(data, end, length, FANOUT_XFWD_VLAN_TAGS, &p) != PARSED_OK)
		return XDP_PASS;

	struct fanout_fragment_key fragment_key = {};
	fill_fragment_key(ifindex, &p, &fragment_key);

	struct fanout_backend backend = {};
	__u32 id = 0;
	int chosen = 1;
	int reply = 0;
	int wrong_server = 0;
	int drained = 0;
	int new_association = 0;
	__u32 event = ASSOCIATION_KEPT;
	__u32 reply_moved = 0;
	/* The listener's per-CPU rotation and its position before the choice: a datagram passed to
	 * tc after the choice puts it back, so tc's own choice is this one and the rotation moves
	 * once per datagram (on this CPU: the stack runs tc where XDP ran). */
	__u32 *rotation = NULL;
	__u32 position = 0;
	if (p.has_udp) {
		struct fanout_listener *listener = find_listener(ifindex, &p);
		if (listener) {
			id = listener->id;
			if (!served(id))
				return XDP_PASS; /* a tc_ebpf listener on this interface */
			if (listener->pool_count)
				return pass(id, FANOUT_XFWD_PASS_POOLS);
			/* Before the choice, which has effects (rotation, association). */
			if (checksum_partial(data, end, &p))
				return pass(id, FANOUT_XFWD_PASS_CHECKSUM_PARTIAL);
			rotation = bpf_map_lookup_elem(&FANOUT_MAP_RR, &id);
			if (rotation)
				position = *rotation;
			if (listener->reserved & FANOUT_LISTENER_NAT)
				chosen = choose_associated(listener, &p, &backend, &event);
			else
				chosen = choose(listener, &p, &backend);
		} else {
			int found = find_reply(&p, &backend, &id, &reply_moved);
			if (found == REPLY_NOT_OURS || !served(id))
				return XDP_PASS;
			reply = 1;
			wrong_server = found == REPLY_WRONG_SERVER;
			drained = found == REPLY_DRAINED;
			new_association = found == REPLY_NEW;
			if (checksum_partial(data, end, &p))
				return pass(id, FANOUT_XFWD_PASS_CHECKSUM_PARTIAL);
		}
	} else {
		struct fanout_fragment *remembered = bpf_map_lookup_elem(&FANOUT_MAP_FRAGMENTS, &fragment_key);
		if (!remembered)
			return pass(FANOUT_UNMATCHED_STATS, FANOUT_XFWD_PASS_FRAGMENT);
		id = remembered->listener_id;
		if (!served(id) || remembered->pool_count || remembered->own_verdict != FANOUT_VERDICT_FORWARDED)
			return pass(id, FANOUT_XFWD_PASS_FRAGMENT);
		backend = remembered->backend;
		reply = remembered->direction == FANOUT_DIRECTION_REPLY;
	}
	struct fanout_stats *stats = id < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &id) : NULL;
	if (!stats)
		return XDP_PASS;
	/* The association this datagram made is counted here even when tc finishes the datagram
	 * (tc then finds it made). */
	if (event == ASSOCIATION_CREATED)
		stats->created++;
	else if (event == ASSOCIATION_MOVED)
		stats->moved++;

	__u32 verdict = FANOUT_VERDICT_FORWARDED;
	if (reply && wrong_server) {
		verdict = FANOUT_VERDICT_WRONG_SERVER;
		goto drop;
	}
	if (!reply && !chosen) {
		verdict = FANOUT_VERDICT_NO_BACKEND;
		goto drop;
	}
	if (p.hop_limit <= 1 && !drained) {
		verdict = FANOUT_VERDICT_TTL_EXPIRED;
		goto drop;
	}

	struct bpf_fib_lookup fib = {};
	route_request(&p, &backend, reply, ifindex, p.tot_len, &fib);
	long route = bpf_fib_lookup(ctx, &fib, sizeof(fib), 0);
	/* A backend's datagram to this host itself: no reply to a client (tc passes it up too). */
	if (reply && route == BPF_FIB_LKUP_RET_NOT_FWDED)
		return XDP_PASS;
	if (drained) {
		verdict = FANOUT_VERDICT_DRAINED;
		goto drop;
	}
	if (route == BPF_FIB_LKUP_RET_NO_NEIGH)
		return pass_chosen(id, FANOUT_XFWD_PASS_NO_NEIGHBOUR, rotation, position, event);
	if (route == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return pass_chosen(id, FANOUT_XFWD_PASS_TOO_LARGE, rotation, position, event);
	if (route != BPF_FIB_LKUP_RET_SUCCESS) {
		verdict = FANOUT_VERDICT_NO_ROUTE;
		struct fanout_backend_stats *dropped = reply ? NULL : backend_stats(id, backend.counter_slot);
		if (dropped)
			dropped->no_route++;
		goto drop;
	}
	/* Only through an interface that transmits XDP frames (the arrival one too: a veth's XDP_TX
	 * needs its peer's XDP or GRO as much as a redirect does). */
	__u32 egress = fib.ifindex;
	if (!bpf_map_lookup_elem(&FANOUT_MAP_XFWD_DEVICES, &egress))
		return pass_chosen(id, FANOUT_XFWD_PASS_NO_XDP_XMIT, rotation, position, event);
	int transmit = egress == ifindex;

	if (new_association)
		associate_reply(&p, id, stats, reply_moved);
	/* Later fragments follow the first one's choice, here or in tc. */
	if (p.has_udp && p.fragment) {
		struct fanout_fragment remembered = {};
		remembered.backend = backend;
		remembered.listener_id = id;
		remembered.direction = reply ? FANOUT_DIRECTION_REPLY : FANOUT_DIRECTION_FORWARD;
		remembered.own_verdict = FANOUT_VERDICT_FORWARDED;
		bpf_map_update_elem(&FANOUT_MAP_FRAGMENTS, &fragment_key, &remembered, BPF_ANY);
	}

	/* The ingress link's tag: the frame starts 4 bytes later, its Ethernet header written below
	 * over the tag's end, where the encapsulated protocol already lies in place. */
	if (p.tagged) {
		if (bpf_xdp_adjust_head(ctx, 4)) {
			verdict = FANOUT_VERDICT_REWRITE_FAILED;
			goto drop;
		}
		p.l3 -= 4;
		p.l4 -= 4;
		data = (void *)(long)ctx->data;
		end = (void *)(long)ctx->data_end;
	}
	if (rewrite_frame(data, end, &p, &backend, reply) < 0) {
		verdict = FANOUT_VERDICT_REWRITE_FAILED;
		goto drop;
	}
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end) {
		verdict = FANOUT_VERDICT_REWRITE_FAILED;
		goto drop;
	}
	__builtin_memcpy(eth->h_dest, fib.dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib.smac, ETH_ALEN);
	__u32 sent = end - data;
	long action = transmit ? XDP_TX : bpf_redirect_map(&FANOUT_MAP_XFWD_DEVICES, fib.ifindex, 0);
	if (action != XDP_TX && action != XDP_REDIRECT) {
		verdict = FANOUT_VERDICT_REWRITE_FAILED;
		goto drop;
	}
	struct fanout_backend_stats *per_backend = backend_stats(id, backend.counter_slot);
	if (reply) {
		count(stats, reply, FANOUT_VERDICT_REPLIED);
		stats->reply_bytes += sent;
		if (per_backend) {
			per_backend->replies++;
			per_backend->reply_bytes += sent;
		}
		return action;
	}
	stats->received++;
	stats->bytes_received += length;
	count(stats, reply, FANOUT_VERDICT_FORWARDED);
	stats->bytes_forwarded += sent;
	if (per_backend) {
		per_backend->packets++;
		per_backend->bytes += sent;
	}
	return action;

drop:
	/* A first fragment dropped here: its later fragments follow it to tc, which drops and counts
	 * them with this verdict. */
	if (!reply && p.has_udp && p.fragment) {
		struct fanout_fragment remembered = {};
		remembered.backend = backend;
		remembered.listener_id = id;
		remembered.direction = FANOUT_DIRECTION_FORWARD;
		remembered.own_verdict = verdict;
		bpf_map_update_elem(&FANOUT_MAP_FRAGMENTS, &fragment_key, &remembered, BPF_ANY);
	}
	if (!reply) {
		stats->received++;
		stats->bytes_received += length;
	}
	count(stats, reply, verdict);
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
