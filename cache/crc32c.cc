#include "cache/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace flashd::cache {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

// tables[k][b]: the CRC of byte b followed by k zero bytes (slice-by-8).
constexpr std::array<std::array<uint32_t, 256>, 8> MakeTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
  return t;
}
constexpr auto kTables = MakeTables();

bool DetectHardware() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

const bool kHardware = DetectHardware();

#if defined(__x86_64__)
// The raw register (no inversions) after `n` zero bytes, from `c`.
uint32_t ZeroBytes(uint32_t c, size_t n) {
  for (; n > 0; --n) c = (c >> 8) ^ kTables[0][c & 0xFF];
  return c;
}

// Shifting the register across a fixed number of zero bytes, by the register's four bytes.
struct Shift {
  std::array<std::array<uint32_t, 256>, 4> t;
  explicit Shift(size_t n) {
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = ZeroBytes(b << (8 * k), n);
    }
  }
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
  }
};

const Shift& ShiftLane() {
  static const Shift s(internal::kCrcLane);
  return s;
}
const Shift& ShiftTwoLanes() {
  static const Shift s(2 * internal::kCrcLane);
  return s;
}

// Three lanes of kCrcLane bytes from p (copied to dst when not null) from raw register c.
template <bool kCopy>
__attribute__((target("sse4.2"))) uint64_t ThreeLanes(uint64_t c, uint8_t* dst, const uint8_t* p) {
  constexpr size_t L = internal::kCrcLane;
  uint64_t a = c, b = 0, d = 0;
  for (size_t i = 0; i < L; i += 8) {
    uint64_t x, y, z;
    std::memcpy(&x, p + i, 8);
    std::memcpy(&y, p + L + i, 8);
    std::memcpy(&z, p + 2 * L + i, 8);
    a = _mm_crc32_u64(a, x);
    b = _mm_crc32_u64(b, y);
    d = _mm_crc32_u64(d, z);
    if constexpr (kCopy) {
      std::memcpy(dst + i, &x, 8);
      std::memcpy(dst + L + i, &y, 8);
      std::memcpy(dst + 2 * L + i, &z, 8);
    }
  }
  return ShiftTwoLanes()(static_cast<uint32_t>(a)) ^ ShiftLane()(static_cast<uint32_t>(b)) ^
         static_cast<uint32_t>(d);
}

template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t Sse42(uint32_t crc, uint8_t* dst, const uint8_t* p,
                                                 size_t n) {
  uint64_t c = ~crc;
  for (; n >= 3 * internal::kCrcLane; n -= 3 * internal::kCrcLane) {
    c = ThreeLanes<kCopy>(c, dst, p);
    p += 3 * internal::kCrcLane;
    if constexpr (kCopy) dst += 3 * internal::kCrcLane;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    if constexpr (kCopy) {
      std::memcpy(dst, &v, 8);
      dst += 8;
    }
  }
  for (; n > 0; --n, ++p) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p);
    if constexpr (kCopy) *dst++ = *p;
  }
  return ~static_cast<uint32_t>(c);
}
#endif

}  // namespace

namespace internal {

uint32_t Crc32cTable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // Little-endian loads: the first byte is the low one, as the CRC consumes it.
    c = kTables[7][lo & 0xFF] ^ kTables[6][(lo >> 8) & 0xFF] ^ kTables[5][(lo >> 16) & 0xFF] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xFF] ^ kTables[2][(hi >> 8) & 0xFF] ^
        kTables[1][(hi >> 16) & 0xFF] ^ kTables[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ kTables[0][(c ^ *p) & 0xFF];
  return ~c;
}

#if defined(__x86_64__)
uint32_t Crc32cSse42(uint32_t crc, const void* data, size_t n) {
  return Sse42<false>(crc, nullptr, static_cast<const uint8_t*>(data), n);
}
#else
uint32_t Crc32cSse42(uint32_t crc, const void* data, size_t n) { return Crc32cTable(crc, data, n); }
#endif

}  // namespace internal

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  return kHardware ? internal::Crc32cSse42(crc, data, n) : internal::Crc32cTable(crc, data, n);
}

uint32_t Crc32cExtendCopy(uint32_t crc, void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (kHardware) {
    return Sse42<true>(crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
  }
#endif
  std::memcpy(dst, src, n);
  return internal::Crc32cTable(crc, dst, n);
}

bool Crc32cInHardware() { return kHardware; }

}  // namespace flashd::cache
