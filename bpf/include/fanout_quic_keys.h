/* SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause */
/*
 * The AES-128 keys of quic_lb listeners in the kernel kinds: FANOUT_MAP_QUIC_KEYS, an array of
 * kernel crypto contexts (ecb(aes)) by set key * FANOUT_QUIC_CONFIGS + config ID, and the BPF
 * crypto kfuncs (kernel 6.10+) that make and use them. Defined once here for the two objects that
 * hold the map: the tc program's (bpf/tc_fanout.bpf.c, through fanout_maps.h; the xdp program
 * reuses it) and the syscall program that puts keys in (bpf/fanout_quic_keys.bpf.c): the same
 * definition, so the second takes the first's map (bpf_map__reuse_fd).
 *
 * The kfuncs are weak: on a kernel without them the programs still load, the key program's run
 * fails, and userspace refuses an encrypted quic_lb configuration in tc_ebpf and xdp, saying so.
 * Self-contained; for BPF programs only (Swift sees the names in fanout_shared.h).
 */
#ifndef FANOUT_QUIC_KEYS_H
#define FANOUT_QUIC_KEYS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "fanout_shared.h"

/* The kernel's type, opaque here: a kptr names it by name and kind (a struct), and the kfuncs
 * check the pointer they get against the kernel's own definition. */
struct bpf_crypto_ctx {
	int opaque;
};

/* bpf_crypto_ctx_create's parameters, as kernel/bpf/crypto.c defines them. */
struct bpf_crypto_params {
	char type[14];
	__u8 reserved[2];
	char algo[128];
	__u8 key[256];
	__u32 key_len;
	__u32 authsize;
};

extern struct bpf_crypto_ctx *bpf_crypto_ctx_create(const struct bpf_crypto_params *params, __u32 params__sz,
						    int *err) __ksym __weak;
extern void bpf_crypto_ctx_release(struct bpf_crypto_ctx *ctx) __ksym __weak;
extern int bpf_crypto_encrypt(struct bpf_crypto_ctx *ctx, const struct bpf_dynptr *src,
			      const struct bpf_dynptr *dst, const struct bpf_dynptr *siv) __ksym __weak;
extern int bpf_crypto_decrypt(struct bpf_crypto_ctx *ctx, const struct bpf_dynptr *src,
			      const struct bpf_dynptr *dst, const struct bpf_dynptr *siv) __ksym __weak;

/* A referenced kptr ("kptr": the kernel's tag for one since 6.3). */
struct fanout_quic_key {
	struct bpf_crypto_ctx __attribute__((btf_type_tag("kptr"))) *ctx;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, FANOUT_QUIC_KEY_ENTRIES);
	__type(key, __u32);
	__type(value, struct fanout_quic_key);
} FANOUT_MAP_QUIC_KEYS SEC(".maps");

#endif /* FANOUT_QUIC_KEYS_H */
