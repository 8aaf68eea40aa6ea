/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The decision of the tc and xdp programs (bpf/tc_fanout.bpf.c, bpf/xdp_fanout.bpf.c), written
 * once over hooks: for a parsed datagram, in this order, the listener (or the reply of a nat
 * listener's backend, or the remembered first fragment), the backend, the counters, wrong
 * server, no backend, TTL / hop limit, the route, drained, the association a reply makes, the
 * fragment memory, then the rewrite and transmit, counted forwarded or replied. What the
 * decision drops is offered to a running capture of its listener (fanout_capture.h).
 *
 * What differs between the hooks is how a packet is read and sent, and what XDP leaves to tc:
 * each program defines, before including this header,
 *   FANOUT_CTX        its context type (struct __sk_buff, struct xdp_md)
 *   FANOUT_ACT_DROP   the action that drops (TC_ACT_SHOT, XDP_DROP)
 *   struct fanout_hook  its own state in the decision (tc: the replication pools' work and the
 *                     TTL decrement; xdp: the rotation to put back)
 * and, after it, the hook functions declared below (hook_*): each says what it does at its step
 * and returns an action, or FANOUT_GO_ON to let the decision go on. An action returned by a hook
 * is final (passed on, counted by the hook's own rules).
 *
 * Self-contained: includes what it uses; for the programs that share the tc program's maps only.
 */
#ifndef FANOUT_DECIDE_H
#define FANOUT_DECIDE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "parse.h"
#include "fanout_maps.h"
#include "fanout_choice.h"
#include "fanout_nat.h"
#include "fanout_templates.h"
#include "fanout_quic.h"
#include "fanout_rate.h"
#include "fanout_capture.h"

#if !defined(FANOUT_CTX) || !defined(FANOUT_ACT_DROP)
#error "define FANOUT_CTX and FANOUT_ACT_DROP (and struct fanout_hook) before including fanout_decide.h"
#endif

/* A hook's "not final: go on with the decision": no action of either hook (XDP's are 0 to 4,
 * tc's -1, TC_ACT_UNSPEC, to 8). */
#define FANOUT_GO_ON (-2)

/* One datagram's decision so far. Forward: `backend` is the new destination. Reply: the
 * listener's address and port (the new source), with the replying backend's counter slot. */
struct fanout_decision {
	FANOUT_CTX *ctx;
	struct packet p;
	struct fanout_fragment_key fragment_key;
	struct fanout_backend backend;
	struct fanout_stats *stats;
	__u32 ifindex;      /* the arrival interface */
	__u32 length;       /* the packet's length as it arrived */
	__u32 id;           /* the listener's (reply: of the replying backend's listener) */
	__u8 chosen;        /* a backend was found (forward) */
	__u8 reply;
	__u8 wrong_server;
	__u8 drained;
	__u8 new_association;
	__u8 quic;          /* enum fanout_quic_outcome, counted where the hook finishes it */
	__u8 rate;          /* the source's buckets were charged (fanout_rate.h) */
	__u8 amp;           /* amplification: charged where it leaves (fanout_amp_note) */
	__u32 event;        /* enum association_event */
	__u32 reply_moved;
	/* FANOUT_VERDICT_FORWARDED, or for a later fragment what became of its first fragment at
	 * the listener's own backend (it may still go to the listener's pools). */
	__u32 own_verdict;
	struct fanout_hook hook;
};

/* The hooks (defined by the program file; see the top of this header). */

/* The first hook: sets up the hook's own state (c->hook, zeroed), and parses the packet into
 * c->p (c->ctx, ifindex and length are set). FANOUT_GO_ON for a UDP datagram or fragment, else
 * the action for what is not one (counted as the hook counts it). */
static __always_inline int hook_parse(struct fanout_decision *c);
/* Not this listener set's packet: no listener, no reply, no listener stats, a backend's
 * datagram to this host itself. The action that lets it continue untouched. */
static __always_inline int hook_not_ours(struct fanout_decision *c);
/* A datagram of listener c->id (`listener`; NULL: a reply) before anything is chosen: whether
 * this hook finishes it. */
static __always_inline int hook_admit(struct fanout_decision *c, struct fanout_listener *listener);
/* After the listener's backend was chosen (the listener's other choices). */
static __always_inline void hook_chosen(struct fanout_decision *c, struct fanout_listener *listener);
/* A later fragment with no remembered first fragment. */
static __always_inline int hook_untracked(struct fanout_decision *c);
/* A later fragment following its remembered first fragment (c->backend, id, reply set). */
static __always_inline int hook_follow(struct fanout_decision *c, struct fanout_fragment *remembered);
/* Before the listener's own verdicts: what leaves ahead of its own datagram. < 0: the packet
 * cannot go on (counted rewrite_failed). */
static __always_inline int hook_ahead(struct fanout_decision *c);
/* Where the route's answer is written, zeroed: `on_stack`, or scratch off the stack where the
 * program's callbacks need the room (tc: the pools' copies reach the next-hop cache from two
 * bpf_loop levels down). NULL: nowhere (never for a per-CPU array; counted rewrite_failed). */
static __always_inline struct bpf_fib_lookup *hook_fib(struct fanout_decision *c, struct bpf_fib_lookup *on_stack);
/* The route toward c->backend (reply: from it) into `fib`: bpf_fib_lookup's result. */
static __always_inline long hook_route(struct fanout_decision *c, struct bpf_fib_lookup *fib);
/* The route's verdict (forwarded, forwarded_neigh, too_large, no_route) known: whether this
 * hook can finish the datagram that way. */
static __always_inline int hook_can_send(struct fanout_decision *c, __u32 verdict, struct bpf_fib_lookup *fib);
/* Where a first fragment's decision is written before it goes into FANOUT_MAP_FRAGMENTS, with
 * what the hook adds to it (off the stack: the decision leaves too little), or NULL. */
static __always_inline struct fanout_fragment *hook_fragment_record(struct fanout_decision *c);
/* Rewrites and sends the datagram along `fib` (verdict forwarded or forwarded_neigh): the
 * action, or < 0 when it could not (counted rewrite_failed). */
static __always_inline long hook_send(struct fanout_decision *c, __u32 verdict, struct bpf_fib_lookup *fib);
/* The packet's length as it leaves. */
static __always_inline __u32 hook_sent_length(struct fanout_decision *c);
/* Whether the packet was modified before the listener's own verdict (tc: a replication pool
 * took a copy, made from the packet itself: its tag popped, and rewritten for a member unless
 * the pool had none): a capture says so. */
static __always_inline int hook_rewritten(struct fanout_decision *c);

/* A first fragment's decision, for its later fragments: the backend it left for (verdict
 * FORWARDED), or what became of it. Nothing for a packet that is not a first fragment. */
static __always_inline void remember_fragment(struct fanout_decision *c, __u32 verdict)
{
	if (!c->p.has_udp || !c->p.fragment)
		return;
	struct fanout_fragment *remembered = hook_fragment_record(c);
	if (!remembered)
		return;
	remembered->backend = c->backend;
	remembered->listener_id = c->id;
	remembered->direction = c->reply ? FANOUT_DIRECTION_REPLY : FANOUT_DIRECTION_FORWARD;
	remembered->own_verdict = verdict;
	bpf_map_update_elem(&FANOUT_MAP_FRAGMENTS, &c->fragment_key, remembered, BPF_ANY);
}

/* The UDP payload's bytes in this packet (what a client is credited for sending, by
 * amplification: never more than arrived). */
static __always_inline __u32 udp_payload_here(struct packet *p)
{
	__u32 headers = p->l4 - p->l3 + 8;
	return p->tot_len > headers ? p->tot_len - headers : 0;
}

/* The UDP payload's bytes a datagram is charged (rate_limit's bytes_per_second, a reply under
 * amplification), as the userspace kinds count them: a first fragment is charged the whole
 * datagram its UDP header claims, at least what it carries itself (its later fragments follow
 * its verdict and are not charged again). */
static __always_inline __u32 udp_payload_charged(FANOUT_CTX *ctx, struct packet *p)
{
	__u32 here = udp_payload_here(p);
	if (p->fragment && p->has_udp) {
		__u8 field[8] = {};
		if (hook_load_bytes(ctx, p->l4 + 4, field, 2) == 0) {
			__u32 claimed = (__u32)field[0] << 8 | field[1];
			if (claimed >= 8 && claimed - 8 > here)
				return claimed - 8;
		}
	}
	return here;
}

/* fanout_fragment.own_verdict of a first fragment rate_limit or amplification dropped: its later
 * fragments are dropped too, counted the same way (not a verdict of the stats map). */
#define FANOUT_OWN_ABUSE_DROPPED (FANOUT_VERDICT_COUNT + 1)

/* A client's datagram reached a verdict at this hook: counted received. */
static __always_inline void count_received(struct fanout_decision *c)
{
	if (!c->reply) {
		c->stats->received++;
		c->stats->bytes_received += c->length;
	}
}

/* Left (`action`) with `verdict`, counted, per backend too. */
static __always_inline int sent(struct fanout_decision *c, __u32 verdict, int action)
{
	count_quic(c->id, c->quic);
	__u32 length = hook_sent_length(c);
	/* Computed here, not across the call below: the xdp hook's packet pointers must not be
	 * kept in 32-bit stack slots (the verifier refuses such a spill). */
	barrier_var(length);
	if (c->amp)
		fanout_amp_note(&c->p, c->id, c->reply ? udp_payload_charged(c->ctx, &c->p) : udp_payload_here(&c->p), c->reply);
	struct fanout_stats *stats = c->stats;
	struct fanout_backend_stats *per_backend = backend_stats(c->id, c->backend.counter_slot);
	if (c->reply) {
		count(stats, 1, FANOUT_VERDICT_REPLIED);
		stats->reply_bytes += length;
		if (per_backend) {
			per_backend->replies++;
			per_backend->reply_bytes += length;
		}
		return action;
	}
	count_received(c);
	count(stats, 0, verdict);
	stats->bytes_forwarded += length;
	if (per_backend) {
		per_backend->packets++;
		per_backend->bytes += length;
	}
	return action;
}

/* A client's datagram (or fragment) dropped for its downstream's sake: counted there too. */
static __always_inline void count_downstream_drop(struct fanout_decision *c, __u32 verdict)
{
	if (verdict != FANOUT_VERDICT_NO_ROUTE && verdict != FANOUT_VERDICT_TOO_LARGE)
		return;
	struct fanout_backend_stats *dropped = backend_stats(c->id, c->backend.counter_slot);
	if (!dropped)
		return;
	if (verdict == FANOUT_VERDICT_NO_ROUTE)
		dropped->no_route++;
	else
		dropped->too_large++;
}

/* rate_limit: a client's datagram above its source's rates, or a new source above the ceiling
 * (counted by fanout_rate_limited): counted received, dropped before anything is chosen for it
 * (no rotation turn, no association). Each replication pool of the listener counts it offered
 * and dropped (rate_limited, at the pool's id), as the userspace kinds' pools do. */
static __always_inline int drop_rate_limited(struct fanout_decision *c, struct fanout_listener *listener, __u32 payload)
{
	remember_fragment(c, FANOUT_OWN_ABUSE_DROPPED);
	fanout_capture(c->ctx, &c->p, c->id, FANOUT_CAPTURE_WHY(FANOUT_CAPTURE_RATE_LIMITED, 0));
	struct fanout_stats *stats = c->id < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &c->id) : NULL;
	if (stats) {
		stats->received++;
		stats->bytes_received += c->length;
	}
	__u32 pools = listener->pool_count;
	for (__u32 i = 0; i < FANOUT_MAX_POOLS; i++) {
		if (i >= pools)
			break;
		__u32 pool = listener->pools[i].id;
		struct fanout_stats *offered = pool < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &pool) : NULL;
		if (offered) {
			offered->received++;
			offered->bytes_received += c->length;
		}
		rate_count(pool, payload, 0);
	}
	return FANOUT_ACT_DROP;
}

/* The datagram's listener, backend and direction: from the listener it is for, the nat listener
 * whose backend sent it, or the first fragment it follows. */
static __always_inline int find_datagram(struct fanout_decision *c)
{
	int action;
	if (c->p.has_udp) {
		struct fanout_listener *listener = find_listener(c->ifindex, &c->p);
		if (listener) {
			c->id = listener->id;
			action = hook_admit(c, listener);
			if (action != FANOUT_GO_ON)
				return action;
			if (listener->reserved & FANOUT_LISTENER_RATE) {
				__u32 payload = udp_payload_charged(c->ctx, &c->p);
				if (fanout_rate_limited(&c->p, listener->id, payload))
					return drop_rate_limited(c, listener, payload);
				c->rate = 1;
			}
			c->amp = (listener->reserved & FANOUT_LISTENER_AMP) != 0;
			/* quic_lb: the backend the connection ID names, before the policy and the
			 * association (a client that moved its address keeps its server). */
			int routed = 0;
			if (listener->reserved & FANOUT_LISTENER_QUIC) {
				c->quic = fanout_quic_route(c->ctx, &c->p, listener->id * 2 + (listener->generation & 1), &c->backend);
#ifndef FANOUT_NO_QUIC_CRYPTO
				if (c->quic == FANOUT_QUIC_ENCRYPTED)
					c->quic = fanout_quic_decrypt(&c->backend);
#endif
				routed = c->quic == FANOUT_QUIC_ROUTED;
			}
			if (listener->reserved & FANOUT_LISTENER_NAT)
				c->chosen = choose_associated(listener, &c->p, &c->backend, &c->event, routed);
			else
				c->chosen = routed || choose(listener, &c->p, &c->backend);
			hook_chosen(c, listener);
			if (listener->reserved & FANOUT_LISTENER_TEMPLATES)
				fanout_capture_templates(c->ctx, &c->p, c->id);
			return FANOUT_GO_ON;
		}
		int found = find_reply(&c->p, &c->backend, &c->id, &c->reply_moved);
		if (found == REPLY_NOT_OURS)
			return hook_not_ours(c);
		c->reply = 1;
		c->wrong_server = found == REPLY_WRONG_SERVER;
		c->drained = found == REPLY_DRAINED;
		c->new_association = found == REPLY_NEW;
		return hook_admit(c, NULL);
	}
	struct fanout_fragment *remembered = bpf_map_lookup_elem(&FANOUT_MAP_FRAGMENTS, &c->fragment_key);
	if (!remembered)
		return hook_untracked(c);
	c->backend = remembered->backend;
	c->id = remembered->listener_id;
	c->reply = remembered->direction == FANOUT_DIRECTION_REPLY;
	c->own_verdict = remembered->own_verdict;
	return hook_follow(c, remembered);
}

/* The verdict of a route lookup's result. */
static __always_inline __u32 route_verdict(long route)
{
	if (route == BPF_FIB_LKUP_RET_SUCCESS)
		return FANOUT_VERDICT_FORWARDED;
	if (route == BPF_FIB_LKUP_RET_NO_NEIGH)
		return FANOUT_VERDICT_FORWARDED_NEIGH;
	if (route == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return FANOUT_VERDICT_TOO_LARGE;
	return FANOUT_VERDICT_NO_ROUTE;
}

/* The decision for one packet arriving at `ifindex`, `length` bytes long: the hook's action. */
static __always_inline int fanout_decide(FANOUT_CTX *ctx, __u32 ifindex, __u32 length)
{
	struct fanout_decision c = {};
	c.ctx = ctx;
	c.ifindex = ifindex;
	c.length = length;
	c.chosen = 1;
	c.event = ASSOCIATION_KEPT;
	c.quic = FANOUT_QUIC_NONE;
	c.own_verdict = FANOUT_VERDICT_FORWARDED;
	int action = hook_parse(&c);
	if (action != FANOUT_GO_ON)
		return action;
	fill_fragment_key(ifindex, &c.p, &c.fragment_key);
	action = find_datagram(&c);
	if (action != FANOUT_GO_ON)
		return action;

	/* Neither happens (ids are bounded by userspace, the array has every id). */
	c.stats = c.id < FANOUT_MAX_LISTENERS ? bpf_map_lookup_elem(&FANOUT_MAP_STATS, &c.id) : NULL;
	if (!c.stats)
		return hook_not_ours(&c);
	/* The association the choice made is counted even when the datagram goes on to tc (which
	 * then finds it made). */
	if (c.event == ASSOCIATION_CREATED)
		c.stats->created++;
	else if (c.event == ASSOCIATION_MOVED)
		c.stats->moved++;

	__u32 verdict;
	if (c.reply && c.wrong_server) {
		verdict = FANOUT_VERDICT_WRONG_SERVER;
		goto drop;
	}
	/* amplification: a reply past its client's cap is dropped, counted by fanout_amp_capped;
	 * one that may go is charged where it leaves. (A reply to this host itself passes below,
	 * uncharged: it is no client's.) */
	if (c.reply && !c.drained && c.p.has_udp) {
		int capped = fanout_amp_capped(&c.p, c.id, udp_payload_charged(ctx, &c.p));
		if (capped > 0) {
			remember_fragment(&c, FANOUT_OWN_ABUSE_DROPPED);
			fanout_capture(ctx, &c.p, c.id, FANOUT_CAPTURE_WHY(FANOUT_CAPTURE_AMP_CAPPED, 1));
			return FANOUT_ACT_DROP;
		}
		c.amp = capped == 0;
	}
	/* A later fragment of a datagram rate_limit or amplification dropped: dropped, counted so. */
	if (c.own_verdict == FANOUT_OWN_ABUSE_DROPPED) {
		fanout_capture(ctx, &c.p, c.id, c.reply ? FANOUT_CAPTURE_WHY(FANOUT_CAPTURE_AMP_CAPPED, 1) : FANOUT_CAPTURE_WHY(FANOUT_CAPTURE_RATE_LIMITED, 0));
		if (c.reply) {
			fanout_amp_count(c.id, 0);
		} else {
			count_received(&c);
			rate_count(c.id, 0, 0);
		}
		return FANOUT_ACT_DROP;
	}
	if (!c.reply) {
		/* What leaves ahead of the listener's own datagram (tc: the pools' copies): the
		 * listener's own leaves last, rewritten from the last copy's destination, or not at all. */
		if (hook_ahead(&c) < 0) {
			verdict = FANOUT_VERDICT_REWRITE_FAILED;
			goto drop;
		}
		if (!c.chosen) {
			verdict = FANOUT_VERDICT_NO_BACKEND;
			goto drop;
		}
		/* A later fragment whose first did not leave for the listener's own backend. */
		if (c.own_verdict != FANOUT_VERDICT_FORWARDED && c.own_verdict < FANOUT_VERDICT_COUNT) {
			verdict = c.own_verdict;
			goto drop;
		}
	}
	/* A gone backend's datagram is counted drained (below, once known not to be for this host). */
	if (c.p.hop_limit <= 1 && !c.drained) {
		verdict = FANOUT_VERDICT_TTL_EXPIRED;
		goto drop;
	}

	struct bpf_fib_lookup on_stack;
	struct bpf_fib_lookup *fib = hook_fib(&c, &on_stack);
	if (!fib) {
		verdict = FANOUT_VERDICT_REWRITE_FAILED;
		goto drop;
	}
	long route = hook_route(&c, fib);
	/* A backend's datagram to this host itself (a udp_echo health probe's answer, say) is no
	 * reply to a client: it goes up the stack untouched, and associates nothing. */
	if (c.reply && route == BPF_FIB_LKUP_RET_NOT_FWDED)
		return hook_not_ours(&c);
	/* A backend whose drain ended: what it sends toward a client is dropped, counted (after the
	 * check above, so its datagrams to this host itself still pass). */
	if (c.drained) {
		verdict = FANOUT_VERDICT_DRAINED;
		goto drop;
	}
	verdict = route_verdict(route);
	action = hook_can_send(&c, verdict, fib);
	if (action != FANOUT_GO_ON)
		return action;
	if (verdict != FANOUT_VERDICT_FORWARDED && verdict != FANOUT_VERDICT_FORWARDED_NEIGH)
		goto drop;

	if (c.new_association)
		associate_reply(&c.p, c.id, c.stats, c.reply_moved);
	/* Later fragments follow the first one's choice (only once it is known to leave). */
	remember_fragment(&c, FANOUT_VERDICT_FORWARDED);

	long sending = hook_send(&c, verdict, fib);
	if (sending >= 0)
		return sent(&c, verdict, (int)sending);
	verdict = FANOUT_VERDICT_REWRITE_FAILED;

drop:
	if (!c.reply) {
		/* A dropped first fragment is remembered with its verdict: its later fragments are
		 * dropped the same way (after what the pools took), never passed on untracked. */
		remember_fragment(&c, verdict);
		count_downstream_drop(&c, verdict);
	}
	count_received(&c);
	count(c.stats, c.reply, verdict);
	count_quic(c.id, c.quic);
	if (fanout_capture_wanted(c.id, FANOUT_CAPTURE_WHY(verdict, c.reply)))
		fanout_capture_drop(ctx, &c.p, c.id, FANOUT_CAPTURE_WHY(verdict, c.reply) | (hook_rewritten(&c) ? FANOUT_CAPTURE_WHY_REWRITTEN : 0));
	return FANOUT_ACT_DROP;
}

#endif /* FANOUT_DECIDE_H */
