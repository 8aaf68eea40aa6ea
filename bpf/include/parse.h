/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The packet parser shared by the udp-fanout BPF programs (tc and XDP): Ethernet with up to
 * PARSE_MAX_VLAN_TAGS 802.1Q/802.1ad tags (each program says how many it accepts), IPv4 with
 * options, IPv6 with extension headers, UDP. Works on a (data, data_end) pair, so it serves an
 * skb's linear area and an XDP buffer alike.
 */
#ifndef FANOUT_PARSE_H
#define FANOUT_PARSE_H

#include <linux/types.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif
#ifndef IPPROTO_UDP
#define IPPROTO_UDP 17
#endif
#define PARSE_IPV6_FRAGMENT 44
#define PARSE_ETH_P_8021Q 0x8100
#define PARSE_ETH_P_8021AD 0x88A8

/* The most VLAN tags any program accepts (a QinQ frame: outer 802.1ad, inner 802.1Q). */
#define PARSE_MAX_VLAN_TAGS 2

/* What the parser found. Offsets are from the start of the frame. */
struct packet {
	__u32 l3;          /* network header */
	__u32 l4;          /* UDP header (first fragments and whole datagrams) */
	__u8 family;
	__u8 hop_limit;
	__u8 tagged;       /* 802.1Q/802.1ad tags in the frame data (0 to the caller's limit) */
	__u8 has_udp;      /* the UDP header is in this packet */
	__u8 fragment;     /* part of a fragmented datagram */
	__u8 first;        /* the first fragment (offset 0) */
	__u16 dport;       /* network order */
	__u16 sport;       /* network order */
	__u32 id;          /* fragment identification */
	__u32 tot_len;     /* IP packet length from the header (IPv6: payload + 40) */
	__u32 saddr[4];
	__u32 daddr[4];
};

enum parsed {
	PARSED_OK,
	PARSED_OTHER,     /* not IP, not UDP (or more VLAN tags than accepted): not ours */
	PARSED_MALFORMED, /* IP whose headers end early or are invalid */
};

static __always_inline enum parsed parse_ipv4(void *data, void *end, struct packet *p)
{
	__u8 *ip = data + p->l3;
	if ((void *)(ip + 20) > end)
		return PARSED_MALFORMED;
	__u32 ihl = (ip[0] & 0x0f) * 4;
	if ((ip[0] >> 4) != 4 || ihl < 20)
		return PARSED_MALFORMED;
	if (ip[9] != IPPROTO_UDP)
		return PARSED_OTHER;
	p->family = AF_INET;
	__u32 total_length = ((__u32)ip[2] << 8) | ip[3];
	p->tot_len = total_length;
	p->hop_limit = ip[8];
	p->id = ((__u32)ip[4] << 8) | ip[5];
	__u16 frag = ((__u16)(ip[6] & 0x3f) << 8) | ip[7]; /* MF + offset */
	p->fragment = frag != 0;
	p->first = (frag & 0x1fff) == 0;
	__builtin_memcpy(&p->saddr[0], ip + 12, 4);
	__builtin_memcpy(&p->daddr[0], ip + 16, 4);
	p->l4 = p->l3 + ihl;
	if (total_length < ihl)
		return PARSED_MALFORMED;
	return PARSED_OK;
}

static __always_inline enum parsed parse_ipv6(void *data, void *end, struct packet *p)
{
	__u8 *ip = data + p->l3;
	if ((void *)(ip + 40) > end)
		return PARSED_MALFORMED;
	if ((ip[0] >> 4) != 6)
		return PARSED_MALFORMED;
	p->family = AF_INET6;
	p->hop_limit = ip[7];
	p->tot_len = (((__u32)ip[4] << 8) | ip[5]) + 40;
	__builtin_memcpy(p->saddr, ip + 8, 16);
	__builtin_memcpy(p->daddr, ip + 24, 16);
	__u8 next = ip[6];
	__u32 offset = p->l3 + 40;
	p->first = 1;
	/* Extension headers: hop-by-hop, routing, destination options, fragment. */
#pragma unroll
	for (int i = 0; i < 4; i++) {
		if (next == IPPROTO_UDP)
			break;
		__u8 *ext = data + offset;
		if (next == PARSE_IPV6_FRAGMENT) {
			if ((void *)(ext + 8) > end)
				return PARSED_MALFORMED;
			__u16 frag = ((__u16)ext[2] << 8) | ext[3];
			p->fragment = 1;
			p->first = (frag & 0xfff8) == 0;
			__builtin_memcpy(&p->id, ext + 4, 4);
			next = ext[0];
			offset += 8;
			if (!p->first)
				break;
			continue;
		}
		if (next != 0 && next != 43 && next != 60)
			return PARSED_OTHER;
		if ((void *)(ext + 2) > end)
			return PARSED_MALFORMED;
		next = ext[0];
		offset += ((__u32)ext[1] + 1) * 8;
	}
	if (next != IPPROTO_UDP)
		return PARSED_OTHER;
	p->l4 = offset;
	return PARSED_OK;
}

/*
 * Parses the frame between data and end into p (zeroed by the caller).
 * - frame_len: the whole frame's length (skb->len; for XDP end - data), against which the IP
 *   length is checked: an IP length beyond it is a packet cut in transit.
 * - max_tags: VLAN tags accepted (0 to PARSE_MAX_VLAN_TAGS, a constant); a frame with more is
 *   PARSED_OTHER, as is any frame that is not IPv4/IPv6 carrying UDP.
 */
static __always_inline enum parsed parse_frame(void *data, void *end, __u32 frame_len, const int max_tags,
					       struct packet *p)
{
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return PARSED_OTHER;
	__u16 proto = eth->h_proto;
	__u32 l3 = sizeof(*eth);
	__u8 tags = 0;
#pragma unroll
	for (int i = 0; i < PARSE_MAX_VLAN_TAGS; i++) {
		if (i >= max_tags)
			break;
		if (proto != bpf_htons(PARSE_ETH_P_8021Q) && proto != bpf_htons(PARSE_ETH_P_8021AD))
			break;
		__u8 *tag = data + l3;
		if ((void *)(tag + 4) > end)
			return PARSED_MALFORMED;
		proto = *(__u16 *)(tag + 2);
		l3 += 4;
		tags++;
	}
	p->l3 = l3;
	p->tagged = tags;
	enum parsed result;
	if (proto == bpf_htons(ETH_P_IP))
		result = parse_ipv4(data, end, p);
	else if (proto == bpf_htons(ETH_P_IPV6))
		result = parse_ipv6(data, end, p);
	else
		return PARSED_OTHER;
	if (result != PARSED_OK)
		return result;
	/* An IP length beyond the frame: cut in transit. The stack drops it (and counts it); it
	 * must not be taken, a later fragment least of all, which has no UDP header to show it
	 * short. Trailing bytes (Ethernet padding) are fine. */
	if (p->tot_len > frame_len - p->l3)
		return PARSED_MALFORMED;
	if (!p->first)
		return PARSED_OK;
	/* The UDP header: in every whole datagram and first fragment. */
	if (p->l4 > 0xffff)
		return PARSED_MALFORMED;
	__u8 *udp = data + p->l4;
	if ((void *)(udp + 8) > end)
		return PARSED_MALFORMED;
	p->sport = *(__u16 *)udp;
	p->dport = *(__u16 *)(udp + 2);
	p->has_udp = 1;
	return PARSED_OK;
}

/* The packet's source address as 16 octets, an IPv4 one as ::ffff:a.b.c.d (`addr` zeroed by
 * the caller): the address part of the LPM keys of pools' `sources` and rate_limit's `allow`. */
static __always_inline void source_as_ipv6(struct packet *p, __u8 *addr)
{
	if (p->family == AF_INET) {
		addr[10] = 0xff;
		addr[11] = 0xff;
		__builtin_memcpy(&addr[12], p->saddr, 4);
	} else {
		__builtin_memcpy(addr, p->saddr, 16);
	}
}

#endif /* FANOUT_PARSE_H */
