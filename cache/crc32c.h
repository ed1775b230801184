// CRC32C (Castagnoli; reflected polynomial 0x82F63B78, initial and final value inverted: the
// checksum of iSCSI, ext4 and RocksDB) at memory speed: the SSE4.2 crc32 instruction where the
// CPU has it, chosen once at run time, else a slice-by-8 table version giving the same values.
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

// Whether Crc32cExtend uses the instruction (for benchmarks and logs).
bool Crc32cInHardware();

namespace internal {
// The two implementations, for tests that hold them equal. Crc32cSse42 REQUIRES
// Crc32cInHardware().
uint32_t Crc32cTable(uint32_t crc, const void* data, size_t n);
uint32_t Crc32cSse42(uint32_t crc, const void* data, size_t n);
}  // namespace internal

}  // namespace flashd::cache
