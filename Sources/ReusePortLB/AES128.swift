// SPDX-License-Identifier: Apache-2.0

/// AES-128 (FIPS 197) on single 16-byte blocks: what QUIC-LB's ECB passes need (``QUICLBCodec``),
/// and nothing more (no modes, no padding).
///
/// Table-driven (the usual four 1 KiB tables per direction, built once from the S-box computed
/// in GF(2⁸)), so it allocates nothing per block and needs no library. Table lookups are not
/// constant-time: the key protects which server a connection ID names (linkability), and an
/// observer who can time this process's cache is on the load balancer's host already.
public struct AES128: Sendable {
    private let tables: AESTables
    /// 44 round-key words for encryption, and the equivalent inverse cipher's for decryption.
    private let encryptionKeys: [UInt32]
    private let decryptionKeys: [UInt32]

    /// - Parameter key: 16 bytes.
    public init?(key: [UInt8]) {
        guard key.count == 16 else { return nil }
        let tables = AESTables.shared
        self.tables = tables
        var words = [UInt32](repeating: 0, count: 44)
        for index in 0..<4 {
            words[index] = UInt32(key[4 * index]) << 24 | UInt32(key[4 * index + 1]) << 16 | UInt32(key[4 * index + 2]) << 8 | UInt32(key[4 * index + 3])
        }
        var rcon: UInt32 = 0x01
        for index in 4..<44 {
            var temp = words[index - 1]
            if index % 4 == 0 {
                temp = (temp << 8) | (temp >> 24)
                temp = tables.substituteWord(temp) ^ (rcon << 24)
                rcon = UInt32(AESTables.double(UInt8(rcon)))
            }
            words[index] = words[index - 4] ^ temp
        }
        encryptionKeys = words
        // The equivalent inverse cipher: round keys in reverse order, InvMixColumns applied to
        // every one but the first and last.
        var inverse = [UInt32](repeating: 0, count: 44)
        for round in 0...10 {
            for column in 0..<4 {
                let word = words[4 * (10 - round) + column]
                inverse[4 * round + column] = (round == 0 || round == 10) ? word : tables.inverseMixColumn(word)
            }
        }
        decryptionKeys = inverse
    }

    /// Encrypts the 16 bytes at `input` into `output` (they may be the same).
    public func encrypt(_ input: UnsafeRawPointer, _ output: UnsafeMutableRawPointer) {
        encryptionKeys.withUnsafeBufferPointer { keys in
            let te0 = tables.te0, te1 = tables.te1, te2 = tables.te2, te3 = tables.te3, sbox = tables.sbox
            var s0 = Self.load(input, 0) ^ keys[0], s1 = Self.load(input, 4) ^ keys[1]
            var s2 = Self.load(input, 8) ^ keys[2], s3 = Self.load(input, 12) ^ keys[3]
            var key = 4
            for _ in 1..<10 {
                let t0 = te0[Int(s0 >> 24)] ^ te1[Int((s1 >> 16) & 0xff)] ^ te2[Int((s2 >> 8) & 0xff)] ^ te3[Int(s3 & 0xff)] ^ keys[key]
                let t1 = te0[Int(s1 >> 24)] ^ te1[Int((s2 >> 16) & 0xff)] ^ te2[Int((s3 >> 8) & 0xff)] ^ te3[Int(s0 & 0xff)] ^ keys[key + 1]
                let t2 = te0[Int(s2 >> 24)] ^ te1[Int((s3 >> 16) & 0xff)] ^ te2[Int((s0 >> 8) & 0xff)] ^ te3[Int(s1 & 0xff)] ^ keys[key + 2]
                let t3 = te0[Int(s3 >> 24)] ^ te1[Int((s0 >> 16) & 0xff)] ^ te2[Int((s1 >> 8) & 0xff)] ^ te3[Int(s2 & 0xff)] ^ keys[key + 3]
                s0 = t0; s1 = t1; s2 = t2; s3 = t3
                key += 4
            }
            @inline(__always) func last(_ a: UInt32, _ b: UInt32, _ c: UInt32, _ d: UInt32, _ k: UInt32) -> UInt32 {
                (UInt32(sbox[Int(a >> 24)]) << 24 | UInt32(sbox[Int((b >> 16) & 0xff)]) << 16
                    | UInt32(sbox[Int((c >> 8) & 0xff)]) << 8 | UInt32(sbox[Int(d & 0xff)])) ^ k
            }
            Self.store(last(s0, s1, s2, s3, keys[40]), output, 0)
            Self.store(last(s1, s2, s3, s0, keys[41]), output, 4)
            Self.store(last(s2, s3, s0, s1, keys[42]), output, 8)
            Self.store(last(s3, s0, s1, s2, keys[43]), output, 12)
        }
    }

    /// Decrypts the 16 bytes at `input` into `output` (they may be the same).
    public func decrypt(_ input: UnsafeRawPointer, _ output: UnsafeMutableRawPointer) {
        decryptionKeys.withUnsafeBufferPointer { keys in
            let td0 = tables.td0, td1 = tables.td1, td2 = tables.td2, td3 = tables.td3, inverse = tables.inverseSbox
            var s0 = Self.load(input, 0) ^ keys[0], s1 = Self.load(input, 4) ^ keys[1]
            var s2 = Self.load(input, 8) ^ keys[2], s3 = Self.load(input, 12) ^ keys[3]
            var key = 4
            for _ in 1..<10 {
                let t0 = td0[Int(s0 >> 24)] ^ td1[Int((s3 >> 16) & 0xff)] ^ td2[Int((s2 >> 8) & 0xff)] ^ td3[Int(s1 & 0xff)] ^ keys[key]
                let t1 = td0[Int(s1 >> 24)] ^ td1[Int((s0 >> 16) & 0xff)] ^ td2[Int((s3 >> 8) & 0xff)] ^ td3[Int(s2 & 0xff)] ^ keys[key + 1]
                let t2 = td0[Int(s2 >> 24)] ^ td1[Int((s1 >> 16) & 0xff)] ^ td2[Int((s0 >> 8) & 0xff)] ^ td3[Int(s3 & 0xff)] ^ keys[key + 2]
                let t3 = td0[Int(s3 >> 24)] ^ td1[Int((s2 >> 16) & 0xff)] ^ td2[Int((s1 >> 8) & 0xff)] ^ td3[Int(s0 & 0xff)] ^ keys[key + 3]
                s0 = t0; s1 = t1; s2 = t2; s3 = t3
                key += 4
            }
            @inline(__always) func last(_ a: UInt32, _ b: UInt32, _ c: UInt32, _ d: UInt32, _ k: UInt32) -> UInt32 {
                (UInt32(inverse[Int(a >> 24)]) << 24 | UInt32(inverse[Int((b >> 16) & 0xff)]) << 16
                    | UInt32(inverse[Int((c >> 8) & 0xff)]) << 8 | UInt32(inverse[Int(d & 0xff)])) ^ k
            }
            Self.store(last(s0, s3, s2, s1, keys[40]), output, 0)
            Self.store(last(s1, s0, s3, s2, keys[41]), output, 4)
            Self.store(last(s2, s1, s0, s3, keys[42]), output, 8)
            Self.store(last(s3, s2, s1, s0, keys[43]), output, 12)
        }
    }

    /// One block, as arrays (tests, the C API).
    public func encrypt(_ block: [UInt8]) -> [UInt8] {
        precondition(block.count == 16, "an AES block is 16 bytes")
        var output = [UInt8](repeating: 0, count: 16)
        block.withUnsafeBytes { input in output.withUnsafeMutableBytes { encrypt(input.baseAddress!, $0.baseAddress!) } }
        return output
    }

    public func decrypt(_ block: [UInt8]) -> [UInt8] {
        precondition(block.count == 16, "an AES block is 16 bytes")
        var output = [UInt8](repeating: 0, count: 16)
        block.withUnsafeBytes { input in output.withUnsafeMutableBytes { decrypt(input.baseAddress!, $0.baseAddress!) } }
        return output
    }

    @inline(__always) private static func load(_ pointer: UnsafeRawPointer, _ offset: Int) -> UInt32 {
        UInt32(bigEndian: pointer.loadUnaligned(fromByteOffset: offset, as: UInt32.self))
    }

    @inline(__always) private static func store(_ value: UInt32, _ pointer: UnsafeMutableRawPointer, _ offset: Int) {
        pointer.storeBytes(of: value.bigEndian, toByteOffset: offset, as: UInt32.self)
    }
}

/// The S-boxes and round tables, computed once for the process and never freed.
final class AESTables: Sendable {
    static let shared = AESTables()

    nonisolated(unsafe) let sbox: UnsafeMutablePointer<UInt8>
    nonisolated(unsafe) let inverseSbox: UnsafeMutablePointer<UInt8>
    nonisolated(unsafe) let te0, te1, te2, te3: UnsafeMutablePointer<UInt32>
    nonisolated(unsafe) let td0, td1, td2, td3: UnsafeMutablePointer<UInt32>

    /// Multiplication by x in GF(2⁸) modulo x⁸ + x⁴ + x³ + x + 1.
    static func double(_ value: UInt8) -> UInt8 { (value << 1) ^ (value & 0x80 != 0 ? 0x1b : 0) }

    static func multiply(_ a: UInt8, _ b: UInt8) -> UInt8 {
        var a = a, b = b, product: UInt8 = 0
        while b != 0 {
            if b & 1 != 0 { product ^= a }
            a = double(a)
            b >>= 1
        }
        return product
    }

    private init() {
        sbox = .allocate(capacity: 256)
        inverseSbox = .allocate(capacity: 256)
        // The S-box: the multiplicative inverse in GF(2⁸), then the affine map. Walking the
        // powers of 3 (a generator) and of its inverse gives every pair (p, 1/p).
        var p: UInt8 = 1, q: UInt8 = 1
        sbox[0] = 0x63
        repeat {
            p = p ^ Self.double(p) // p × 3
            q ^= q << 1; q ^= q << 2; q ^= q << 4 // q ÷ 3
            if q & 0x80 != 0 { q ^= 0x09 }
            let rotated = q ^ (q << 1 | q >> 7) ^ (q << 2 | q >> 6) ^ (q << 3 | q >> 5) ^ (q << 4 | q >> 4)
            sbox[Int(p)] = rotated ^ 0x63
        } while p != 1
        for index in 0..<256 { inverseSbox[Int(sbox[index])] = UInt8(index) }
        te0 = .allocate(capacity: 256); te1 = .allocate(capacity: 256); te2 = .allocate(capacity: 256); te3 = .allocate(capacity: 256)
        td0 = .allocate(capacity: 256); td1 = .allocate(capacity: 256); td2 = .allocate(capacity: 256); td3 = .allocate(capacity: 256)
        for index in 0..<256 {
            let s = sbox[index]
            let word = UInt32(Self.double(s)) << 24 | UInt32(s) << 16 | UInt32(s) << 8 | UInt32(Self.double(s) ^ s)
            te0[index] = word
            te1[index] = word >> 8 | word << 24
            te2[index] = word >> 16 | word << 16
            te3[index] = word >> 24 | word << 8
            let i = inverseSbox[index]
            let inverseWord = UInt32(Self.multiply(i, 0x0e)) << 24 | UInt32(Self.multiply(i, 0x09)) << 16
                | UInt32(Self.multiply(i, 0x0d)) << 8 | UInt32(Self.multiply(i, 0x0b))
            td0[index] = inverseWord
            td1[index] = inverseWord >> 8 | inverseWord << 24
            td2[index] = inverseWord >> 16 | inverseWord << 16
            td3[index] = inverseWord >> 24 | inverseWord << 8
        }
    }

    func substituteWord(_ word: UInt32) -> UInt32 {
        UInt32(sbox[Int(word >> 24)]) << 24 | UInt32(sbox[Int((word >> 16) & 0xff)]) << 16
            | UInt32(sbox[Int((word >> 8) & 0xff)]) << 8 | UInt32(sbox[Int(word & 0xff)])
    }

    /// InvMixColumns of one column: td(S(x)) is the inverse mix of byte x alone.
    func inverseMixColumn(_ word: UInt32) -> UInt32 {
        td0[Int(sbox[Int(word >> 24)])] ^ td1[Int(sbox[Int((word >> 16) & 0xff)])]
            ^ td2[Int(sbox[Int((word >> 8) & 0xff)])] ^ td3[Int(sbox[Int(word & 0xff)])]
    }
}
