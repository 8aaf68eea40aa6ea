// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * A packet reflector for the two-way benchmark's load-generator phase (make bench only, never
 * embedded). Attached at tc ingress of an endpoint's veth (a client's or a real server's), it
 * answers every IPv4 UDP datagram at once by sending it back out of the same veth with the
 * Ethernet, IP and UDP source and destination swapped: at a real server that is an echo reply,
 * at a client it is the client's next request. A fixed number of datagrams then circulate
 * through the load balancer, each lap a round trip, at a cost to the endpoints of a few hundred
 * nanoseconds, so the load balancer (on a CPU of its own) is what bounds the rate, as with a
 * hardware packet generator. Swapping leaves the IP and UDP checksums valid (sums commute);
 * the TTL, which every pass through a router takes one from, is set back to 64 (the IP header
 * checksum updated as in RFC 1624), so a datagram can lap for ever.
 * Anything else (ARP, ICMP, IPv6) goes to the stack.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "csum.h"

SEC("tc")
int reflect(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->protocol != IPPROTO_UDP || ip->ihl != 5
	    || (ip->frag_off & bpf_htons(0x3fff)))
		return TC_ACT_OK;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end)
		return TC_ACT_OK;
	unsigned char mac[ETH_ALEN];
	__builtin_memcpy(mac, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, mac, ETH_ALEN);
	__be32 address = ip->saddr;
	ip->saddr = ip->daddr;
	ip->daddr = address;
	__u16 old = *(__u16 *)&ip->ttl; /* the TTL and protocol word, as it lies */
	ip->ttl = 64;
	ip->check = csum_update16(ip->check, old, *(__u16 *)&ip->ttl);
	__be16 port = udp->source;
	udp->source = udp->dest;
	udp->dest = port;
	return bpf_redirect(skb->ifindex, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
