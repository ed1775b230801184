// CRC32C (Castagnoli; reflected polynomial 0x82F63B78, initial and final value inverted: the
// checksum of iSCSI, ext4 and RocksDB) at memory speed: the SSE4.2 crc32 instruction where the
// CPU has it, chosen once at run time, else a slice-by-8 table version giving the same values.
// The instruction's latency is three times its issue rate, so long inputs run as three streams
// of kCrcLane bytes at once, joined by shifting the first two across the bytes after them (the
// CRC register is linear in its state: a shift by n zero bytes is four table lookups).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace flashd::cache {

// The CRC32C of the bytes `crc` was computed over followed by [data, data + n); 0 starts.
// Crc32cExtend(Crc32cExtend(0, a), b) is the CRC32C of a then b.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

// Crc32cExtend over [src, src + n) that also copies those bytes to dst (the ranges must not
// overlap): a checked copy reads its source once.
uint32_t Crc32cExtendCopy(uint32_t crc, void* dst, const void* src, size_t n);

// Whether Crc32cExtend uses the instruction (for benchmarks and logs).
bool Crc32cInHardware();

namespace internal {
// The two implementations, for tests that hold them equal. Crc32cSse42 REQUIRES
// Crc32cInHardware().
uint32_t Crc32cTable(uint32_t crc, const void* data, size_t n);
uint32_t Crc32cSse42(uint32_t crc, const void* data, size_t n);
constexpr size_t kCrcLane = 1024;
}  // namespace internal

}  // namespace flashd::cache
