// SPDX-License-Identifier: Apache-2.0
/// udp-fanout's `udp_echo` health probe as the collector sees it: 16 bytes (a per-target random
/// token, then the probe's sequence number, both big-endian u64), and a success only when the
/// target sends back exactly those bytes (docs/health.md, FanoutCore's `ProbeLoop`). The
/// collector answers it unchanged so `collector --echo` can be a health-checked downstream; every
/// other datagram gets the tag as before.
public enum HealthProbe {
    /// The probe's size in bytes.
    public static let size = 16

    /// Whether `bytes` is a udp_echo probe: exactly the probe's size and not the publisher's
    /// header (`Payload`), so a 16-byte publisher datagram is still tagged. A probe whose random
    /// token happens to begin with the publisher's "RPLB" magic (one in 2^32) is tagged too.
    public static func matches(_ bytes: UnsafeRawBufferPointer) -> Bool {
        bytes.count == size && Payload.read(bytes) == nil
    }
}
