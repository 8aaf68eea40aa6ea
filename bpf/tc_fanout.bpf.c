// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * tc ingress program of udp-fanout's tc_ebpf mode: each UDP datagram to a listener's address
 * and port goes to one of the listener's backends, rewritten and redirected in the kernel.
 *
 * Parse Ethernet (one 802.1Q/802.1ad tag), IPv4 (with options) or IPv6 (with extension
 * headers), UDP, with the shared parser (bpf/include/parse.h; checksum helpers in csum.h). Match the arrival interface and destination against the listeners map (exact
 * address first, then the family's wildcard). Pick a backend: per-CPU weighted rotation or a source-address
 * lookup table (Sources/FanoutCore/Balancing/SourceTable.swift). Look up the route to the backend (bpf_fib_lookup), then rewrite destination
 * address and port with incremental checksum updates (a zero IPv4 UDP checksum stays zero),
 * decrement TTL / hop limit, and redirect. The source address is not touched (one-way and the
 * client direction of a nat listener; a nat listener's replies get their source rewritten).
 *
 * Fragments: the first fragment's choice is remembered by (source, destination, IP id) and
 * later fragments follow it, so a datagram is reassembled whole at one backend.
 *
 * Replication (`pools:`, fanout_pools.h): each datagram of a listener with pools is first copied
 * to every pool that takes it (bpf_clone_redirect, the client's source kept), then its own
 * datagram leaves as above; fragments follow their first fragment's pools too.
 *
 * Two-way listeners (fanout_listener.reserved & FANOUT_LISTENER_NAT, `replies: nat`): a client
 * keeps its backend through the listener's association map (an LRU hash, inner map of
 * FANOUT_MAP_ASSOCIATIONS at the listener's id) while that backend is live (FANOUT_MAP_LIVE).
 * A datagram that matches no listener but comes from a live backend is a reply: to the client
 * associated with that backend it leaves from the listener's address and port (source NAT,
 * checksums, TTL, fib, redirect); to a client of another backend it is dropped (WRONG_SERVER);
 * to a client with no association it creates one (server initiated) and leaves the same way.
 * A backend that left the set drains (FANOUT_LIVE_DRAINING): no new client, its clients move on
 * their next datagram, and its replies to them still leave from the listener's address until
 * userspace marks it gone after settings.drain_secs (FANOUT_LIVE_GONE: dropped, DRAINED).
 *
 * Everything that is not a datagram for a listener passes untouched and continues down the
 * chain (FANOUT_PASS). Every other outcome is a counted verdict (enum fanout_verdict).
 *
 * The order of the decision and what is counted is bpf/include/fanout_decide.h, shared with the
 * xdp program; this file holds the tc hook's part (hook_*): how the packet is read (a pull when
 * the headers lie outside the linear area), the pools' decisions and copies, and the way out
 * (VLAN pop, rewrite, bpf_redirect or bpf_redirect_neigh). The maps are in
 * bpf/include/fanout_maps.h, the choice of a backend in fanout_choice.h, the reply direction in
 * fanout_nat.h, route, rewrite and redirect in fanout_redirect.h, replication in fanout_pools.h.
 *
 * Three steps are global functions (fanout_tc_parse, fanout_tc_decide_pools, fanout_tc_copies):
 * the verifier checks each once, on its own, instead of once per path that reaches it. The
 * program's verification processes about 175,000 instructions (inlined, it exceeded the kernel's
 * limit of 1,000,000: the parser's exact results multiplied the paths below it). Their pointer
 * arguments are checked for NULL, as the verifier requires of a global function's.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"   /* the maps and their counter accessors */
#include "fanout_choice.h"    /* listener, backend (rotation, source table, association), fragment key */
#include "fanout_nat.h"       /* the reply direction of nat listeners */
#include "fanout_redirect.h"  /* route, VLAN pop, rewrite with checksums, MACs, redirect */
#include "fanout_pools.h"     /* replication: each datagram copied to the listener's pools */

/* VLAN tags accepted in the frame: one (the tag is popped before the redirect). */
#define FANOUT_TC_VLAN_TAGS 1

/* Not ours: continue down the chain. TC_ACT_OK would end it, so every later clsact filter
 * and TCX program (firewalls, Cilium) would never see the packet; TC_ACT_UNSPEC is TCX_NEXT
 * for a TCX link and "next filter" for cls_bpf, and when nothing follows the kernel passes
 * the packet to the stack as with TC_ACT_OK. */
#define FANOUT_PASS TC_ACT_UNSPEC

/* Bytes made linear when headers lie outside the skb's head: the rewrite's L4 bound (512)
 * plus the UDP header. */
#define FANOUT_PULL_BYTES 520

static __always_inline enum parsed parse(struct __sk_buff *skb, struct packet *p)
{
	return parse_frame((void *)(long)skb->data, (void *)(long)skb->data_end, skb->len, FANOUT_TC_VLAN_TAGS, p);
}

/* Makes the headers direct-access when the driver left them in page fragments (a short
 * copied head, header split): only the linear area lies between skb->data and data_end.
 * Returns whether anything was pulled, so the caller parses again. Up to the longest headers
 * the rewrite handles (L4 offset 512, UDP header 8), never past the packet. */
static __always_inline int pull_headers(struct __sk_buff *skb)
{
	__u32 linear = skb->data_end - skb->data;
	__u32 length = skb->len;
	if (linear >= length)
		return 0;
	__u32 want = length < FANOUT_PULL_BYTES ? length : FANOUT_PULL_BYTES;
	if (want <= linear)
		return 0;
	return bpf_skb_pull_data(skb, want) == 0;
}

/* The tc hook's part of the decision (fanout_decide.h): the replication pools' decisions (the
 * per-CPU scratch; NULL when the listener has no pools) and whether the TTL / hop limit is still
 * to be decremented by the listener's own rewrite (0 once a pool's copy did).
 *
 * Stack: the decision, its callees and two levels of the pools' bpf_loop callbacks share the
 * 512 bytes (fanout_tc -> fanout_tc_copies -> pool_step -> member_step is the deepest chain):
 * under 8 bytes are left on kernel 6.18 (the copies' next-hop cache fits only because the
 * decision's route answer lives in the pools' scratch: hook_fib), so a field added to struct
 * fanout_decision, this struct or struct replication may make the verifier refuse the program
 * ("combined stack size ... Too large"); move such state into a per-CPU map, as the pools'
 * scratch is. docs/development.md says how to check. */
struct fanout_hook {
	struct fanout_fragment *work;
	__u32 hop;
};

#define FANOUT_CTX struct __sk_buff
#define FANOUT_ACT_DROP TC_ACT_SHOT
#include "fanout_decide.h"   /* the decision, shared with the xdp program */

/* flow_templates (fanout_templates.h): the packet's bytes wherever they lie (linear or not). */
static __always_inline long hook_load_bytes(struct __sk_buff *skb, __u32 offset, void *to, __u32 length)
{
	return bpf_skb_load_bytes(skb, offset, to, length);
}

/* Parses (verified once, a global function), pulling the headers into the linear area when
 * they lie outside it. bpf_skb_pull_data moves the packet: no caller may keep a packet pointer
 * across this call (none does: the decision reads the packet through its helpers afterwards). */
__noinline int fanout_tc_parse(struct __sk_buff *skb, struct packet *p)
{
	if (!skb || !p)
		return PARSED_OTHER;
	enum parsed parsed = parse(skb, p);
	/* Headers cut short in the linear area but present in the packet: pull and look again. */
	if (parsed == PARSED_MALFORMED && pull_headers(skb)) {
		__builtin_memset(p, 0, sizeof(*p));
		parsed = parse(skb, p);
	}
	return parsed;
}

/* What is not a UDP datagram or fragment continues down the chain, counted unmatched. */
static __always_inline int hook_parse(struct fanout_decision *c)
{
	c->hook.hop = 1;
	int parsed = fanout_tc_parse(c->ctx, &c->p);
	if (parsed == PARSED_OTHER) {
		count_unmatched(FANOUT_VERDICT_NOT_OURS);
		return FANOUT_PASS;
	}
	if (parsed != PARSED_OK) {
		count_unmatched(FANOUT_VERDICT_MALFORMED);
		return FANOUT_PASS;
	}
	return FANOUT_GO_ON;
}

static __always_inline int hook_not_ours(struct fanout_decision *c)
{
	count_unmatched(FANOUT_VERDICT_NOT_OURS);
	return FANOUT_PASS;
}

/* tc takes every datagram of every listener at its interface. */
static __always_inline int hook_admit(struct fanout_decision *c, struct fanout_listener *listener)
{
	return FANOUT_GO_ON;
}

__noinline int fanout_tc_decide_pools(struct fanout_listener *listener, struct packet *p, __u32 length, struct fanout_fragment *work)
{
	if (!listener || !p || !work)
		return 0;
	decide_pools(listener, p, length, work);
	return 0;
}

/* The listener's pools decide too. */
static __always_inline void hook_chosen(struct fanout_decision *c, struct fanout_listener *listener)
{
	if (!listener->pool_count)
		return;
	c->hook.work = pool_scratch();
	if (c->hook.work)
		fanout_tc_decide_pools(listener, &c->p, c->length, c->hook.work);
}

static __always_inline int hook_untracked(struct fanout_decision *c)
{
	count_unmatched(FANOUT_VERDICT_FRAGMENT_UNTRACKED);
	return FANOUT_PASS;
}

/* A later fragment follows its first fragment's pools too. */
static __always_inline int hook_follow(struct fanout_decision *c, struct fanout_fragment *remembered)
{
	if (c->reply || !remembered->pool_count)
		return FANOUT_GO_ON;
	struct fanout_fragment *work = pool_scratch();
	if (work) {
		work->pool_count = remembered->pool_count;
		__builtin_memcpy(work->pools, remembered->pools, sizeof(work->pools));
		count_decisions(work, c->length);
	}
	c->hook.work = work;
	return FANOUT_GO_ON;
}

/* The pools' copies, verified once (a global function): -1 when the packet cannot go on, else
 * whether the TTL / hop limit is still to be decremented. The copies rewrite the packet and pop
 * its tag: as after fanout_tc_parse, no caller keeps a packet pointer across the call. */
__noinline int fanout_tc_copies(struct __sk_buff *skb, struct packet *p, struct fanout_fragment *work)
{
	__u32 hop = 1;
	if (!skb || !p || !work)
		return -1;
	if (send_copies(skb, p, work, &hop) < 0)
		return -1;
	return hop;
}

/* The pools' copies leave first. */
static __always_inline int hook_ahead(struct fanout_decision *c)
{
	if (!c->hook.work)
		return 0;
	int hop = fanout_tc_copies(c->ctx, &c->p, c->hook.work);
	if (hop < 0)
		return -1;
	c->hook.hop = hop;
	return 0;
}

/* The per-CPU scratch's: the pools' copies are done with it by then (hook_ahead), and the
 * 64 bytes off the program's stack leave their callbacks the room for the next-hop cache. */
static __always_inline struct bpf_fib_lookup *hook_fib(struct fanout_decision *c, struct bpf_fib_lookup *on_stack)
{
	struct pool_scratch *space = scratch();
	if (!space)
		return NULL;
	__builtin_memset(&space->fib, 0, sizeof(space->fib));
	return &space->fib;
}

static __always_inline long hook_route(struct fanout_decision *c, struct bpf_fib_lookup *fib)
{
	return lookup_route_cached(c->ctx, &c->p, &c->backend, c->reply, c->id, fib);
}

/* tc sends whatever routes. */
static __always_inline int hook_can_send(struct fanout_decision *c, __u32 verdict, struct bpf_fib_lookup *fib)
{
	return FANOUT_GO_ON;
}

/* The pools' record (their decisions kept with it), or the per-CPU scratch with no pools. */
static __always_inline struct fanout_fragment *hook_fragment_record(struct fanout_decision *c)
{
	if (c->hook.work)
		return c->hook.work;
	struct fanout_fragment *record = pool_scratch();
	if (record)
		record->pool_count = 0;
	return record;
}

/* The ingress link's tag off, the rewrite (fanout_redirect.h), then the fib's MACs and
 * bpf_redirect, or bpf_redirect_neigh when the next hop's address is not known yet. */
static __always_inline long hook_send(struct fanout_decision *c, __u32 verdict, struct bpf_fib_lookup *fib)
{
	struct __sk_buff *skb = c->ctx;
	if (pop_vlan(skb, &c->p) < 0)
		return -1;
	if (rewrite(skb, &c->p, &c->backend, c->reply, c->hook.hop) < 0)
		return -1;
	long redirected;
	if (verdict == FANOUT_VERDICT_FORWARDED) {
		if (write_macs(skb, fib) < 0)
			return -1;
		redirected = bpf_redirect(fib->ifindex, 0);
	} else {
		redirected = redirect_neigh(&c->p, fib);
	}
	return redirected == TC_ACT_REDIRECT ? redirected : -1;
}

static __always_inline __u32 hook_sent_length(struct fanout_decision *c)
{
	return c->ctx->len;
}

static __always_inline __u32 hook_current_length(struct __sk_buff *skb)
{
	return skb->len;
}

/* A pool took a copy: the copies were made from the packet itself (its tag popped, rewritten for
 * a member unless the pool had none). */
static __always_inline int hook_rewritten(struct fanout_decision *c)
{
	struct fanout_fragment *work = c->hook.work;
	if (!work)
		return 0;
	__u32 pools = work->pool_count;
	for (__u32 i = 0; i < FANOUT_MAX_POOLS; i++) {
		if (i < pools && work->pools[i].outcome == FANOUT_POOL_TAKEN)
			return 1;
	}
	return 0;
}

SEC("tc")
int FANOUT_PROG_TC(struct __sk_buff *skb)
{
	return fanout_decide(skb, skb->ifindex, skb->len);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
