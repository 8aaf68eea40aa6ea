import BPFSupport

/// The error of a failed system or libbpf call (defined in BPFSupport, shared with udp-fanout's
/// loaders): kept under this name, which ReusePortLB's API has always used.
public typealias SystemCallError = BPFSupport.SystemCallError
