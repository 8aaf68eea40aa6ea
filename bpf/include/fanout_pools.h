/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * Replication in the tc program (bpf/tc_fanout.bpf.c): each datagram of a listener with `pools:`
 * is also copied to each pool that takes it, in the kernel, before the listener's own datagram
 * leaves (docs/replication.md).
 *
 * decide_pools, for a whole datagram or a first fragment: per pool, in order, `sources` (an LPM
 * trie lookup under the pool's id), then `sample` (one source address in N by rplb_source_hash
 * with FANOUT_SAMPLE_SEED, as every other kind), then the member (rotation or source table of the
 * pool's own set, as a listener's; or every member, FANOUT_POLICY_ALL). The decisions go into a
 * per-CPU scratch record (struct fanout_fragment: kept as the fragment's memory when the datagram
 * is fragmented, so later fragments reach the same members).
 *
 * send_copies: per taken pool and member, the route (route_forward: the next-hop cache at the
 * pool's id and the member's slot while the daemon's route generation holds, else
 * bpf_fib_lookup), the rewrite of destination
 * address and port with checksums (the client's source kept), TTL / hop limit decremented once
 * over all copies, the fib lookup's MACs, and bpf_clone_redirect of the packet as it is now (the
 * kernel unclones the original's head after each clone, so later rewrites do not reach a copy
 * in flight). The listener's own datagram is rewritten last from the last copy's destination
 * and redirected as before. A copy whose next hop has no neighbour entry cannot wait for one
 * (bpf_clone_redirect has no neighbour variant): it is dropped and counted
 * FANOUT_VERDICT_NO_NEIGHBOUR, and userspace keeps managed neighbour entries for the pools'
 * next hops.
 *
 * Counted at the pool's id: every datagram offered (`received`), its outcome in `verdicts`
 * (FORWARDED: its copy left, or, for ALL, it was copied to the members; NO_BACKEND, TTL_EXPIRED,
 * and a balanced pool's copy's drop reason), `sampled_out`, `filtered_out`; so received =
 * forwarded + dropped + sampled_out + filtered_out. Per member (backend stats at the pool's id
 * and the member's slot): copies sent and bytes, and copies dropped by reason.
 *
 * Loops are bpf_loop callbacks (pools, then members), so the verifier checks one copy's code
 * once, whatever the number of pools and members. Self-contained: includes what it uses; for
 * the tc program only.
 */
#ifndef FANOUT_POOLS_H
#define FANOUT_POOLS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "rplb_shared.h"
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"
#include "fanout_choice.h"
#include "fanout_redirect.h"

/* Scratch per CPU (a tc program runs to its end on one CPU), off the 512-byte stack that the
 * program and two levels of bpf_loop callbacks share: the pools' decisions for the packet being
 * handled (first, so a pointer to the record is one to its decisions), and a route: each copy's,
 * then the listener's own datagram's (hook_fib), which leaves the program's stack the room the
 * copies' next-hop cache takes in the callbacks. */
struct pool_scratch {
	struct fanout_fragment work;
	struct bpf_fib_lookup fib;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct pool_scratch);
} fanout_scratch SEC(".maps");

static __always_inline struct pool_scratch *scratch(void)
{
	__u32 key = 0;
	return bpf_map_lookup_elem(&fanout_scratch, &key);
}

static __always_inline struct fanout_fragment *pool_scratch(void)
{
	struct pool_scratch *found = scratch();
	return found ? &found->work : NULL;
}

/* The source address is in the pool's `sources` (of the pool's generation in force: `key` is its
 * id * 2 + generation, so a reload's new prefixes take over with the flip). */
static __always_inline int pool_source_matches(__u32 pool_key, struct packet *p)
{
	struct fanout_pool_source_key key = {};
	key.prefixlen = 32 + 128;
	key.pool_id = pool_key;
	source_as_ipv6(p, key.addr);
	return bpf_map_lookup_elem(&FANOUT_MAP_POOL_SOURCES, &key) != NULL;
}

/* Counts what a pool's decision was, at the pool's id: one more datagram offered, and its
 * outcome unless it is taken (a taken one's is counted when its copy leaves or not). */
static __always_inline void count_decision(__u32 id, __u32 outcome, __u32 length)
{
	struct fanout_stats *stats = id < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &id) : NULL;
	if (!stats)
		return;
	stats->received++;
	stats->bytes_received += length;
	if (outcome == FANOUT_POOL_FILTERED)
		stats->filtered_out++;
	else if (outcome == FANOUT_POOL_SAMPLED)
		stats->sampled_out++;
	else if (outcome == FANOUT_POOL_NO_MEMBER)
		count(stats, 0, FANOUT_VERDICT_NO_BACKEND);
	else if (outcome == FANOUT_POOL_TTL_EXPIRED)
		count(stats, 0, FANOUT_VERDICT_TTL_EXPIRED);
}

/* What decide_pools' callback shares (on the program's stack). */
struct decision_context {
	struct fanout_listener *listener;
	struct packet *p;
	struct fanout_fragment *work;
	__u32 length;
	__u32 sample_hash;
};

static long decide_step(__u64 index, void *context)
{
	struct decision_context *d = context;
	if (index >= FANOUT_MAX_POOLS)
		return 1;
	struct fanout_pool *pool = &d->listener->pools[index];
	struct fanout_fragment_pool *decision = &d->work->pools[index];
	struct packet *p = d->p;
	__u32 id = pool->id;
	__u32 outcome = FANOUT_POOL_TAKEN;
	__u32 member = 0;
	if (p->hop_limit <= 1) {
		/* As the listener's own: a datagram whose TTL runs out goes nowhere. */
		outcome = FANOUT_POOL_TTL_EXPIRED;
	} else if ((pool->flags & FANOUT_POOL_SOURCES) && !pool_source_matches(id * 2 + (pool->generation & 1), p)) {
		outcome = FANOUT_POOL_FILTERED;
	} else if (pool->sample > 1 && rplb_reduce(d->sample_hash, pool->sample) != 0) {
		outcome = FANOUT_POOL_SAMPLED;
	} else if (pool->policy == FANOUT_POLICY_ALL) {
		__u32 set_key = id * 2 + (pool->generation & 1);
		struct fanout_set *set = bpf_map_lookup_elem(&FANOUT_MAP_SETS, &set_key);
		if (!set || set->count == 0)
			outcome = FANOUT_POOL_NO_MEMBER;
		member = FANOUT_FRAGMENT_EVERY_MEMBER;
	} else {
		struct fanout_set *set = NULL;
		int chosen = choose_index(id, pool->generation, pool->policy, p, &set);
		if (chosen < 0)
			outcome = FANOUT_POOL_NO_MEMBER;
		else
			member = chosen;
	}
	decision->id = id;
	decision->generation = pool->generation;
	decision->member = member;
	decision->outcome = outcome;
	count_decision(id, outcome, d->length);
	return 0;
}

/* Decides, for every pool of `listener`, whether it takes this datagram (or why not) and which
 * member gets it, into `work` (its pools and pool_count), and counts the decisions. */
static __always_inline void decide_pools(struct fanout_listener *listener, struct packet *p, __u32 length,
					 struct fanout_fragment *work)
{
	__u32 pools = listener->pool_count;
	if (pools > FANOUT_MAX_POOLS)
		pools = FANOUT_MAX_POOLS;
	work->pool_count = pools;
	struct decision_context d = {};
	d.listener = listener;
	d.p = p;
	d.work = work;
	d.length = length;
	d.sample_hash = rplb_source_hash(p->saddr, p->family == AF_INET ? 1 : 4, 0, FANOUT_SAMPLE_SEED, 0);
	bpf_loop(pools, decide_step, &d, 0);
}

static long recount_step(__u64 index, void *context)
{
	struct decision_context *d = context;
	if (index >= FANOUT_MAX_POOLS)
		return 1;
	count_decision(d->work->pools[index].id, d->work->pools[index].outcome, d->length);
	return 0;
}

/* A later fragment: its datagram's decisions (remembered, in `work`) are counted again, as the
 * listener counts every fragment it receives. */
static __always_inline void count_decisions(struct fanout_fragment *work, __u32 length)
{
	__u32 pools = work->pool_count;
	if (pools > FANOUT_MAX_POOLS)
		pools = FANOUT_MAX_POOLS;
	struct decision_context d = {};
	d.work = work;
	d.length = length;
	bpf_loop(pools, recount_step, &d, 0);
}

/* What send_copies' callbacks share (on the program's stack). */
struct replication {
	struct __sk_buff *skb;
	struct packet *p;
	struct fanout_fragment *work;
	struct fanout_set *set;        /* the pool being copied to */
	struct fanout_stats *stats;    /* its counters */
	__u32 pool_id;
	__u32 first;                   /* its members [first, first + members) */
	__u32 balanced;                /* one member: the copy's verdict is the datagram's */
	__u32 hop;                     /* 1 until a copy decremented the TTL / hop limit */
	__u32 broken;                  /* a rewrite failed half-way: the packet cannot go on */
};

/* One copy: route, rewrite from the current destination, MACs, clone out. Returns the verdict. */
static __always_inline __u32 copy_to(struct replication *r, struct fanout_backend *to)
{
	struct __sk_buff *skb = r->skb;
	struct packet *p = r->p;
	struct pool_scratch *space = scratch();
	if (!space)
		return FANOUT_VERDICT_REWRITE_FAILED;
	struct bpf_fib_lookup *fib = &space->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	long route = route_forward(skb, p, to, r->pool_id, skb->ifindex, skb->gso_size == 0 ? p->tot_len : 0, fib);
	if (route == BPF_FIB_LKUP_RET_NO_NEIGH)
		return FANOUT_VERDICT_NO_NEIGHBOUR;
	if (route == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return FANOUT_VERDICT_TOO_LARGE;
	if (route != BPF_FIB_LKUP_RET_SUCCESS)
		return FANOUT_VERDICT_NO_ROUTE;
	if (rewrite(skb, p, to, 0, r->hop) < 0) {
		r->broken = 1;
		return FANOUT_VERDICT_REWRITE_FAILED;
	}
	r->hop = 0;
	__builtin_memcpy(p->daddr, to->addr, sizeof(p->daddr));
	p->dport = to->port;
	if (write_macs(skb, fib) < 0)
		return FANOUT_VERDICT_REWRITE_FAILED;
	if (bpf_clone_redirect(skb, fib->ifindex, 0) != 0)
		return FANOUT_VERDICT_REWRITE_FAILED;
	return FANOUT_VERDICT_FORWARDED;
}

static long member_step(__u64 index, void *context)
{
	struct replication *r = context;
	struct fanout_set *set = r->set;
	__u32 at = r->first + (__u32)index;
	if (at >= set->count || at >= FANOUT_MAX_BACKENDS)
		return 1;
	struct fanout_backend *to = &set->backends[at];
	__u32 verdict = copy_to(r, to);
	__u32 length = r->skb->len;
	struct fanout_backend_stats *member = backend_stats(r->pool_id, to->counter_slot);
	if (member) {
		if (verdict == FANOUT_VERDICT_FORWARDED) {
			member->packets++;
			member->bytes += length;
		} else if (verdict == FANOUT_VERDICT_NO_ROUTE) {
			member->no_route++;
		} else if (verdict == FANOUT_VERDICT_TOO_LARGE) {
			member->too_large++;
		} else if (verdict == FANOUT_VERDICT_NO_NEIGHBOUR) {
			member->no_neighbour++;
		} else {
			member->rewrite_failed++;
		}
	}
	if (r->balanced) {
		count(r->stats, 0, verdict);
		if (verdict == FANOUT_VERDICT_FORWARDED)
			r->stats->bytes_forwarded += length;
	}
	return r->broken ? 1 : 0;
}

static long pool_step(__u64 index, void *context)
{
	struct replication *r = context;
	if (index >= FANOUT_MAX_POOLS)
		return 1;
	struct fanout_fragment_pool *decision = &r->work->pools[index];
	if (decision->outcome != FANOUT_POOL_TAKEN)
		return 0;
	__u32 id = decision->id;
	struct fanout_stats *stats = id < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &id) : NULL;
	if (!stats)
		return 0;
	__u32 set_key = id * 2 + (decision->generation & 1);
	struct fanout_set *set = bpf_map_lookup_elem(&FANOUT_MAP_SETS, &set_key);
	__u32 members = 1;
	__u32 first = decision->member;
	if (first == FANOUT_FRAGMENT_EVERY_MEMBER) {
		first = 0;
		members = set ? set->count : 0;
	}
	if (!set || members == 0 || first >= set->count) {
		count(stats, 0, FANOUT_VERDICT_NO_BACKEND);
		return 0;
	}
	r->set = set;
	r->stats = stats;
	r->pool_id = id;
	r->first = first;
	r->balanced = decision->member != FANOUT_FRAGMENT_EVERY_MEMBER;
	if (!r->balanced)
		count(stats, 0, FANOUT_VERDICT_FORWARDED);
	bpf_loop(members, member_step, r, 0);
	return r->broken ? 1 : 0;
}

/* Sends the copies `work` decided (the VLAN tag of the ingress link popped first). Returns 0, or
 * -1 when the packet cannot go on (a helper failed half-way through a rewrite). `*hop` is 0
 * afterwards if a copy decremented the TTL / hop limit (the listener's own rewrite must not
 * again). */
static __always_inline int send_copies(struct __sk_buff *skb, struct packet *p, struct fanout_fragment *work,
				       __u32 *hop)
{
	__u32 pools = work->pool_count;
	if (pools == 0)
		return 0;
	if (pools > FANOUT_MAX_POOLS)
		pools = FANOUT_MAX_POOLS;
	int any = 0;
	for (__u32 i = 0; i < FANOUT_MAX_POOLS; i++) {
		if (i < pools && work->pools[i].outcome == FANOUT_POOL_TAKEN)
			any = 1;
	}
	if (!any)
		return 0;
	if (pop_vlan(skb, p) < 0)
		return -1;
	struct replication r = {};
	r.skb = skb;
	r.p = p;
	r.work = work;
	r.hop = *hop;
	bpf_loop(pools, pool_step, &r, 0);
	*hop = r.hop;
	return r.broken ? -1 : 0;
}

#endif /* FANOUT_POOLS_H */
