// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * Puts the AES-128 key of one quic_lb configuration into the tc program's key map
 * (FANOUT_MAP_QUIC_KEYS, fanout_quic_keys.h), or takes one out: a BPF_PROG_TYPE_SYSCALL program
 * run by userspace (BPF_PROG_TEST_RUN) with a struct fanout_quic_key_args, because a kernel
 * crypto context can be made only by bpf_crypto_ctx_create in a sleepable program. Returns 0 or
 * a negative errno. The context a slot held before is released (the programs reading it hold RCU,
 * so a datagram being decided finishes with the old key).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"
#include "fanout_quic_keys.h"

#ifndef EINVAL
#define EINVAL 22
#endif
#ifndef ENOENT
#define ENOENT 2
#endif
#ifndef EOPNOTSUPP
#define EOPNOTSUPP 95
#endif

SEC("syscall")
int FANOUT_PROG_QUIC_KEYS(struct fanout_quic_key_args *args)
{
	__u32 slot = args->slot;
	if (slot >= FANOUT_QUIC_KEY_ENTRIES)
		return -EINVAL;
	struct fanout_quic_key *value = bpf_map_lookup_elem(&FANOUT_MAP_QUIC_KEYS, &slot);
	if (!value)
		return -ENOENT;
	if (!bpf_crypto_ctx_create || !bpf_crypto_ctx_release)
		return -EOPNOTSUPP;
	struct bpf_crypto_ctx *created = NULL;
	if (!args->clear) {
		struct bpf_crypto_params params = {
			.type = "skcipher",
			.algo = "ecb(aes)",
			.key_len = 16,
		};
		__builtin_memcpy(params.key, args->key, 16);
		int err = 0;
		created = bpf_crypto_ctx_create(&params, sizeof(params), &err);
		if (!created)
			return err < 0 ? err : -EINVAL;
	}
	struct bpf_crypto_ctx *old = bpf_kptr_xchg(&value->ctx, created);
	if (old)
		bpf_crypto_ctx_release(old);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
