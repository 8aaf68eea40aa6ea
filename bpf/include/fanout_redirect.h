/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The way out of the tc program (bpf/tc_fanout.bpf.c), once a datagram's new destination (or,
 * for a reply, its new source) is known: the route toward it (lookup_route: bpf_fib_lookup,
 * with the route's MTU check), the ingress link's VLAN tags popped (pop_vlan), the rewrite of
 * address, port, checksums and TTL / hop limit (rewrite), and the redirect's two ways: the
 * Ethernet addresses from the fib lookup (write_macs, then bpf_redirect) or the kernel's
 * neighbour resolution (redirect_neigh). Which way, and what is counted, the program decides.
 * Uses the load-time options of fanout_maps.h (FANOUT_OPTIONS.ipv6_csum_flags) and csum.h's
 * incremental updates. Self-contained: includes linux/bpf.h, linux/if_ether.h, bpf_helpers.h,
 * bpf_core_read.h (unless FANOUT_HELPER_CSUM), fanout_shared.h, parse.h (struct packet,
 * AF_INET, IPPROTO_UDP), csum.h, fanout_maps.h and fanout_hops.h itself, so nothing has to come
 * before it; like fanout_maps.h, for the tc program, and the xdp program for route_request and
 * route_forward (its object leaves out the checksum state's kfunc and CO-RE read, unused).
 */
#ifndef FANOUT_REDIRECT_H
#define FANOUT_REDIRECT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"
#include "csum.h"
#include "fanout_maps.h"
#include "fanout_hops.h"

/* The route request toward the datagram's new destination, into `fib` (zeroed by the caller):
 * `to` is the backend (forward) or the listener's address and port (reply), `ifindex` the arrival
 * interface, `tot_len` the IP length the route's MTU is checked against (0: not checked). The tc
 * and xdp programs alike; each then calls bpf_fib_lookup with its own context. `reply` is a
 * _Bool: as an int it compiled the selects below into other (equivalent) instructions than the
 * program had when this code was inline. */
static __always_inline void route_request(struct packet *p, struct fanout_backend *to, _Bool reply,
					  __u32 ifindex, __u32 tot_len, struct bpf_fib_lookup *fib)
{
	fib->family = p->family;
	fib->l4_protocol = IPPROTO_UDP;
	fib->sport = reply ? to->port : p->sport;
	fib->dport = reply ? p->dport : to->port;
	fib->tot_len = tot_len;
	fib->ifindex = ifindex;
	/* Forward: from the client to the backend. Reply: from the listener's address to the client. */
	__u32 *source = reply ? to->addr : p->saddr;
	__u32 *destination = reply ? p->daddr : to->addr;
	if (p->family == AF_INET) {
		fib->ipv4_src = source[0];
		fib->ipv4_dst = destination[0];
	} else {
		__builtin_memcpy(fib->ipv6_src, source, 16);
		__builtin_memcpy(fib->ipv6_dst, destination, 16);
	}
}

/* The route of a client's datagram toward backend or pool member `to` (slot to->counter_slot of
 * listener `id`), arrived at `ifindex`, `tot_len` its IP length (0: not checked), into
 * `fib` (zeroed by the caller): bpf_fib_lookup's result. While the daemon's route generation
 * holds (fanout_hops.h), a successful answer is kept and used again for the next datagram toward
 * the same destination from the same interface, as long as it is no longer than the route's MTU;
 * a longer one, and every datagram while the cache is off, is looked up. A lookup that checks no
 * length (`tot_len` 0) is never kept nor answered from the cache: the kernel then checks the
 * packet against the device's MTU itself. */
static __always_inline long route_forward(void *ctx, struct packet *p, struct fanout_backend *to, __u32 id,
					  __u32 ifindex, __u32 tot_len, struct bpf_fib_lookup *fib)
{
	/* The generation in force before the lookup: its answer is kept as of then, so a change the
	 * daemon writes while the lookup runs makes it stale at once. */
	__u32 generation = 0;
	if (tot_len) {
		struct fanout_route_state *state = route_state_on();
		struct fanout_hop *hop = state ? hop_entry(id, to->counter_slot) : NULL;
		if (state)
			generation = state->generation;
		if (hop && hop_answers(hop, generation, to->addr, p->family, ifindex, tot_len, fib))
			return BPF_FIB_LKUP_RET_SUCCESS;
	}
	route_request(p, to, 0, ifindex, tot_len, fib);
	long route = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	/* The entry found again rather than kept across the call (less to spill on the stack). */
	if (route == BPF_FIB_LKUP_RET_SUCCESS && generation) {
		struct fanout_hop *hop = hop_entry(id, to->counter_slot);
		if (hop)
			hop_keep(hop, generation, to->addr, p->family, ifindex, fib);
	}
	return route;
}

/* The route toward the datagram's new destination (route_request), into `fib`; the egress
 * interface, MACs and next hop are read from it afterwards. Returns bpf_fib_lookup's result.
 * The route's MTU is checked against the IP length, so a packet the egress device would drop
 * uncounted is dropped here as too_large. A GSO packet (GRO-merged) is checked by the kernel per
 * segment on the way out: tot_len 0 skips the check. Looked up each time: replies (nat). */
static __always_inline long lookup_route(struct __sk_buff *skb, struct packet *p, struct fanout_backend *to,
					 _Bool reply, struct bpf_fib_lookup *fib)
{
	route_request(p, to, reply, skb->ifindex, skb->gso_size == 0 ? p->tot_len : 0, fib);
	return bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
}

/* The same for the listener's own datagram, a client's (not `reply`) through the next-hop cache
 * (route_forward) with its backend slot of listener `id`. */
static __always_inline long lookup_route_cached(struct __sk_buff *skb, struct packet *p, struct fanout_backend *to,
						_Bool reply, __u32 id, struct bpf_fib_lookup *fib)
{
	if (reply)
		return lookup_route(skb, p, to, reply, fib);
	return route_forward(skb, p, to, id, skb->ifindex, skb->gso_size == 0 ? p->tot_len : 0, fib);
}

/* Pops the VLAN tags of the ingress link (in the frame, then in skb metadata too) and moves the
 * parsed offsets with the frame's. Returns < 0 if the kernel refused. */
static __always_inline int pop_vlan(struct __sk_buff *skb, struct packet *p)
{
	/* A tag in the frame or in skb metadata belongs to the ingress link, not the egress. */
	if (p->tagged || skb->vlan_present) {
		if (bpf_skb_vlan_pop(skb) < 0)
			return -1;
		if (p->tagged) {
			p->l3 -= 4;
			p->l4 -= 4;
		}
		if (p->tagged && skb->vlan_present && bpf_skb_vlan_pop(skb) < 0)
			return -1;
		/* Popped: a second call (the listener's own after its pools' copies) does nothing. */
		p->tagged = 0;
	}
	return 0;
}

/* The skb's checksum state (ip_summed), which says how a UDP checksum is updated: read from the
 * kernel's struct sk_buff (bpf_cast_to_kern_ctx, kernel 6.2: the verifier turns the call into a
 * register move; the field's place comes from the kernel's BTF at load). The plain program
 * (tc_fanout_plain.bpf.c: kernels without the BPF crypto kfuncs, before 6.10, or where the full
 * one does not load) defines FANOUT_HELPER_CSUM: every update goes through
 * bpf_l4_csum_replace, as for CHECKSUM_COMPLETE. */
#define FANOUT_CHECKSUM_COMPLETE 2
#define FANOUT_CHECKSUM_PARTIAL 3

#ifndef FANOUT_HELPER_CSUM
#include <bpf/bpf_core_read.h>
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

struct sk_buff___fanout {
	__u8 ip_summed:2;
} __attribute__((preserve_access_index));

static __always_inline __u32 checksum_state(struct __sk_buff *skb)
{
	struct sk_buff___fanout *kernel = bpf_cast_to_kern_ctx(skb);
	return BPF_CORE_READ_BITFIELD(kernel, ip_summed);
}
#else
static __always_inline __u32 checksum_state(struct __sk_buff *skb)
{
	return FANOUT_CHECKSUM_COMPLETE;
}
#endif

/* A rewrite's UDP checksum update for the change of address `old_addr` to to->addr and port
 * `old_port` to to->port, as bpf_l4_csum_replace makes it with BPF_F_MARK_MANGLED_0 (a zero
 * checksum, none, stays zero; a result of zero is written 0xffff). In place, one update for
 * address and port, unless the skb is CHECKSUM_COMPLETE: skb->csum must then follow the
 * pseudo-header's change, which only the helper may write, so it is called (for the address,
 * then the port). CHECKSUM_PARTIAL (a local sender's checksum offload, as through a veth) holds
 * only the pseudo-header's sum, not complemented: the address change is added in, the port's is
 * left to whoever completes the checksum. Each helper call saved cost 25-50 ns
 * (docs/benchmarks.md, "The UDP checksum in place"). A PARTIAL skb whose checksum is an inner
 * header's (a locally sent tunnel) is taken as this header's, as the helper took it. 0, or -1
 * when the checksum could not be updated. */
static __always_inline int udp_check(struct __sk_buff *skb, struct packet *p, struct fanout_backend *to,
				     __u32 *old_addr, __u16 old_port, __u32 hop)
{
	/* The pseudo-header's change: each old 16-bit word complemented, each new one added. */
	__u64 sum = 0;
	int words = p->family == AF_INET ? 1 : 4;
#pragma unroll
	for (int i = 0; i < 4; i++) {
		if (i < words)
			sum += (~old_addr[i] & 0xffff) + (~old_addr[i] >> 16) + (to->addr[i] & 0xffff) + (to->addr[i] >> 16);
	}
	__u32 pseudo = csum_fold64(sum);
	__u32 ports = to->port != old_port ? (__u32)(__u16)~old_port + to->port : 0;
	__u32 at = p->l4 + 6;
	__u32 summed = checksum_state(skb);
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	if (at > 518)
		return -1;
	__u16 *field = data + at;
	if ((void *)(field + 1) > end)
		return -1;
	__u32 check = *field;
	if (summed == FANOUT_CHECKSUM_COMPLETE) {
		/* An IPv6 hop limit's decrement has no header checksum to make up for it: skb->csum
		 * takes it (the word at offset 6, next header and hop limit, one less in its second
		 * byte: 0xfeff, -0x100 in one's complement, as the word is loaded). No checksum to
		 * update (zero): nothing in the datagram makes up for the port's change, nor for an
		 * IPv6 address's (an IPv4 one is in the header its own checksum covers), so skb->csum
		 * takes them too. */
		__u32 uncovered = (words == 4 && hop ? 0xfeff : 0) + (check ? 0 : ports + (words == 4 ? pseudo : 0));
		if (uncovered)
			bpf_csum_update(skb, uncovered);
		if (!check)
			return 0;
		if (bpf_l4_csum_replace(skb, at, 0, pseudo,
					BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 | (words == 4 ? FANOUT_OPTIONS.ipv6_csum_flags : 0)))
			return -1;
		if (ports && bpf_l4_csum_replace(skb, at, 0, ports, BPF_F_MARK_MANGLED_0))
			return -1;
		return 0;
	}
	if (!check)
		return 0;
	/* Without branches (each would double the verifier's paths through every rewrite): PARTIAL
	 * adds the pseudo-header's change to the sum as it is; otherwise the checksum is
	 * complemented around the update, and the port's change goes in too. */
	__u32 partial = summed & (summed >> 1) & 1;
	__u32 others = partial - 1;   /* all ones unless PARTIAL (`ports` may carry into bit 16) */
	__u32 flip = others & 0xffff;
	check = csum_fold64((__u64)(check ^ flip) + pseudo + (ports & others)) ^ flip;
	/* A result of zero is written 0xffff (zero says "no checksum"). */
	*field = check | (((check - 1) >> 16) & 0xffff);
	return 0;
}

/* Writes the new destination, fixes the checksums, decrements TTL / hop limit when `hop` (once
 * per packet: a replication pool's copy may have done it already, see fanout_pools.h).
 *
 * The UDP checksum last (udp_check, whose helpers may move the packet). Everything else is
 * written directly: the IPv4 header checksum is updated in place, which
 * keeps the header's sum, and so skb->csum, unchanged. */
static __always_inline int rewrite(struct __sk_buff *skb, struct packet *p, struct fanout_backend *to, int reply, __u32 hop)
{
	/* Forward: the destination address and port change; reply: the source. */
	__u32 *old_addr = reply ? p->saddr : p->daddr;
	__u16 old_port = reply ? p->sport : p->dport;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 l3 = p->l3, l4 = p->l4;
	if (l3 > 18 || l4 > 512)
		return -1;
	if (p->family == AF_INET) {
		__u8 *ip = data + l3;
		if ((void *)(ip + 20) > end)
			return -1;
		__u32 at = reply ? 12 : 16;
		__u16 check = *(__u16 *)(ip + 10);
		if (hop) {
			__u16 old_word = *(__u16 *)(ip + 8);
			ip[8] -= 1;
			check = csum_update16(check, old_word, *(__u16 *)(ip + 8));
		}
		check = csum_update32(check, *(__u32 *)(ip + at), to->addr[0]);
		*(__u32 *)(ip + at) = to->addr[0];
		*(__u16 *)(ip + 10) = check;
	} else {
		__u8 *ip = data + l3;
		if ((void *)(ip + 40) > end)
			return -1;
		if (hop)
			ip[7] -= 1;
		__builtin_memcpy(ip + (reply ? 8 : 24), to->addr, 16);
	}
	if (!p->has_udp)
		return 0;
	if (to->port != old_port) {
		__u8 *udp = data + l4;
		if ((void *)(udp + 8) > end)
			return -1;
		*(__u16 *)(udp + (reply ? 0 : 2)) = to->port;
	}
	/* Last: its helpers (CHECKSUM_COMPLETE) move the packet. */
	return udp_check(skb, p, to, old_addr, old_port, hop);
}

/* Ethernet addresses from the fib lookup. */
static __always_inline int write_macs(struct __sk_buff *skb, struct bpf_fib_lookup *fib)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return -1;
	__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	return 0;
}

/* The redirect when the fib lookup did not know the next hop's Ethernet address
 * (FANOUT_VERDICT_FORWARDED_NEIGH): the kernel resolves it for the route's next hop. Returns
 * bpf_redirect_neigh's result (TC_ACT_REDIRECT when it took the packet). */
static __always_inline long redirect_neigh(struct packet *p, struct bpf_fib_lookup *fib)
{
	struct bpf_redir_neigh neighbour = {};
	if (p->family == AF_INET) {
		neighbour.nh_family = AF_INET;
		neighbour.ipv4_nh = fib->ipv4_dst;
	} else {
		neighbour.nh_family = AF_INET6;
		__builtin_memcpy(neighbour.ipv6_nh, fib->ipv6_dst, 16);
	}
	return bpf_redirect_neigh(fib->ifindex, &neighbour, sizeof(neighbour), 0);
}

#endif /* FANOUT_REDIRECT_H */
