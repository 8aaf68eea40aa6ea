// SPDX-License-Identifier: Apache-2.0
// libbpf's option structs (`struct bpf_*_opts`) filled the way its LIBBPF_OPTS macro does.

/// Calls `body` with a libbpf options struct whose every byte is zero, padding included, and
/// whose `sz` is its size; `body` sets the fields it needs through the pointer and passes it on.
///
/// Why not `var options = bpf_xdp_query_opts()`: libbpf refuses (EINVAL, "has non-zero extra
/// bytes") an options struct with a non-zero byte between its last field and `sz`, and Swift's
/// initialiser sets the fields, not the padding. An optimised build leaves whatever the stack
/// held in `bpf_xdp_query_opts`'s 7 bytes after `attach_mode` (issue 21: every af_xdp start
/// could fail there). C's `LIBBPF_OPTS` memsets; it is not imported. The struct is never copied
/// as a Swift value (a copy need not keep padding either): it lives in zeroed storage until
/// `body` returns.
/// - Parameters:
///   - type: a libbpf options struct; its first field must be `size_t sz`, as in every one.
///   - body: sets the fields and makes the call; outputs are read through the pointer too.
/// - Returns: what `body` returns.
package func withLibbpfOptions<Options, Result, Failure: Error>(
    _ type: Options.Type, _ body: (UnsafeMutablePointer<Options>) throws(Failure) -> Result
) throws(Failure) -> Result {
    let size = MemoryLayout<Options>.size
    let storage = UnsafeMutableRawPointer.allocate(byteCount: size, alignment: MemoryLayout<Options>.alignment)
    defer { storage.deallocate() }
    storage.initializeMemory(as: UInt8.self, repeating: 0, count: size)
    storage.storeBytes(of: size, as: Int.self)  // sz
    return try body(storage.bindMemory(to: Options.self, capacity: 1))
}
