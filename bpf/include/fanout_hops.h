/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The next-hop cache's maps and accessors (fanout_hops_shared.h says what it keeps and when it
 * holds), for the tc and xdp programs: the xdp program is loaded with the tc program's maps, so
 * both read one route generation and fill one cache. Used by route_forward (fanout_redirect.h).
 * Self-contained: includes linux/bpf.h, linux/if_ether.h, bpf_helpers.h, fanout_shared.h,
 * fanout_hops_shared.h and parse.h (struct packet) itself.
 */
#ifndef FANOUT_HOPS_H
#define FANOUT_HOPS_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "fanout_hops_shared.h"
#include "parse.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fanout_route_state);
} FANOUT_MAP_ROUTE_STATE SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FANOUT_MAX_LISTENERS * FANOUT_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct fanout_hop);
} FANOUT_MAP_HOPS SEC(".maps");

/* The route state while the cache is on (a generation, before its deadline), else NULL. */
static __always_inline struct fanout_route_state *route_state_on(void)
{
	__u32 zero = 0;
	struct fanout_route_state *state = bpf_map_lookup_elem(&FANOUT_MAP_ROUTE_STATE, &zero);
	if (!state || !state->generation || bpf_ktime_get_coarse_ns() >= state->valid_until)
		return NULL;
	return state;
}

/* This CPU's entry for backend slot `slot` of listener `id`, or NULL. */
static __always_inline struct fanout_hop *hop_entry(__u32 id, __u32 slot)
{
	if (id >= FANOUT_MAX_LISTENERS || slot >= FANOUT_MAX_BACKENDS)
		return NULL;
	__u32 key = id * FANOUT_MAX_BACKENDS + slot;
	return bpf_map_lookup_elem(&FANOUT_MAP_HOPS, &key);
}

/* Whether `hop` answers the lookup toward `addr` of a `family` datagram of IP length `tot_len`
 * that arrived at `ifindex`, at `generation`: then its way out and MACs are put into `fib`, as
 * bpf_fib_lookup would have. */
static __always_inline int hop_answers(struct fanout_hop *hop, __u32 generation, const __u32 *addr, __u8 family,
				       __u32 ifindex, __u32 tot_len, struct bpf_fib_lookup *fib)
{
	if (hop->generation != generation || hop->ifindex != ifindex || hop->family != family || tot_len > hop->mtu)
		return 0;
	if (hop->addr[0] != addr[0] || hop->addr[1] != addr[1] || hop->addr[2] != addr[2] || hop->addr[3] != addr[3])
		return 0;
	fib->ifindex = hop->egress;
	__builtin_memcpy(fib->smac, hop->smac, ETH_ALEN);
	__builtin_memcpy(fib->dmac, hop->dmac, ETH_ALEN);
	return 1;
}

/* Keeps bpf_fib_lookup's successful answer in `fib` (its mtu_result the route's MTU the length
 * was checked against) as `hop`'s, at `generation`. */
static __always_inline void hop_keep(struct fanout_hop *hop, __u32 generation, const __u32 *addr, __u8 family,
				     __u32 ifindex, struct bpf_fib_lookup *fib)
{
	/* Not an answer while written (a program preempted on a real-time kernel): the compiler
	 * may not drop or move this store past the others. */
	hop->generation = 0;
	asm volatile("" ::: "memory");
	__builtin_memcpy(hop->addr, addr, sizeof(hop->addr));
	hop->ifindex = ifindex;
	hop->family = family;
	hop->egress = fib->ifindex;
	hop->mtu = fib->mtu_result;
	__builtin_memcpy(hop->smac, fib->smac, ETH_ALEN);
	__builtin_memcpy(hop->dmac, fib->dmac, ETH_ALEN);
	asm volatile("" ::: "memory");
	hop->generation = generation;
}

#endif /* FANOUT_HOPS_H */
