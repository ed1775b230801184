// kernels/fmath.h against the C library's double functions: each result must be the float
// nearest the double result (or, where that lies within 1e-12 of a rounding midpoint, one of the
// two floats beside it), over random arguments across each function's range and the edges.
#include "kernels/fmath.h"

#include <boost/test/unit_test.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace flashd::kernels {
namespace {

// Whether got is the float nearest to the double `want`, allowing either neighbour when want is
// within a relative 1e-12 of the midpoint between two floats.
bool Nearest(float got, double want) {
  if (std::isnan(want)) return std::isnan(got);
  const float rounded = static_cast<float>(want);
  if (got == rounded && std::signbit(got) == std::signbit(rounded)) return true;
  const float other = std::nextafter(rounded, got);
  if (got != other) return false;
  const double mid = (double(rounded) + double(other)) / 2;
  return std::fabs(want - mid) <= 1e-12 * std::fabs(want);
}

std::vector<float> Arguments(float lo, float hi, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

BOOST_AUTO_TEST_SUITE(fmath_functions)

BOOST_AUTO_TEST_CASE(exp_is_correctly_rounded) {
  size_t bad = 0;
  for (float x : Arguments(-104.0f, 89.0f, 2000000, 1))
    bad += !Nearest(fmath::Exp(x), std::exp(double(x)));
  for (float x : Arguments(-1.0f, 1.0f, 500000, 2))
    bad += !Nearest(fmath::Exp(x), std::exp(double(x)));
  // The edges: underflow through the subnormals to 0, overflow to infinity.
  for (float x : {0.0f, -0.0f, 1e-30f, -1e-30f, 88.72f, 88.7228f, 88.73f, -87.3f, -100.0f, -103.9f,
                  -103.98f, -104.0f, 89.0f}) {
    BOOST_TEST(Nearest(fmath::Exp(x), std::exp(double(x))), "exp(" << x << ")");
  }
  BOOST_TEST(bad == 0u);
  const float inf = std::numeric_limits<float>::infinity();
  BOOST_TEST(fmath::Exp(inf) == inf);
  BOOST_TEST(fmath::Exp(-inf) == 0.0f);
  BOOST_TEST(fmath::Exp(1e30f) == inf);
  BOOST_TEST(std::isnan(fmath::Exp(std::numeric_limits<float>::quiet_NaN())));
  BOOST_TEST(fmath::Exp(0.0f) == 1.0f);
}

BOOST_AUTO_TEST_CASE(sigmoid_is_the_reference_formula) {
  for (float x : Arguments(-120.0f, 120.0f, 200000, 3)) {
    const float want = 1.0f / (1.0f + static_cast<float>(std::exp(-double(x))));
    BOOST_TEST(fmath::Sigmoid(x) == want, "sigmoid(" << x << ")");
  }
}

BOOST_AUTO_TEST_CASE(softplus_is_correctly_rounded) {
  size_t bad = 0;
  for (float x : Arguments(-110.0f, 90.0f, 1000000, 4)) {
    bad += !Nearest(fmath::Softplus(x), std::log1p(std::exp(double(x))));
  }
  // Tiny e^x, where 1 + e^x rounds to 1 and the correction carries the result.
  for (float x : Arguments(-60.0f, -30.0f, 100000, 5)) {
    bad += !Nearest(fmath::Softplus(x), std::log1p(std::exp(double(x))));
  }
  BOOST_TEST(bad == 0u);
  BOOST_TEST(fmath::Softplus(100.0f) == 100.0f);
  BOOST_TEST(fmath::Softplus(-200.0f) == 0.0f);
  BOOST_TEST(std::isnan(fmath::Softplus(std::numeric_limits<float>::quiet_NaN())));
}

BOOST_AUTO_TEST_CASE(sin_and_cos_are_correctly_rounded_for_rotary_angles) {
  size_t bad = 0;
  // Small angles, and the angles of positions up to a million tokens.
  for (const auto& [lo, hi] : {std::pair{-10.0f, 10.0f}, std::pair{-1.6e6f, 1.6e6f}}) {
    for (float x : Arguments(lo, hi, 1000000, 6)) {
      float s, c;
      fmath::SinCos(x, &s, &c);
      bad += !Nearest(s, std::sin(double(x))) + !Nearest(c, std::cos(double(x)));
    }
  }
  // Multiples of pi/2 and their neighbours: the quadrant and the reduction's cancellation.
  for (int k = -4000; k <= 4000; ++k) {
    const float x = static_cast<float>(k * 1.5707963267948966);
    for (float y : {std::nextafter(x, -1e9f), x, std::nextafter(x, 1e9f)}) {
      float s, c;
      fmath::SinCos(y, &s, &c);
      bad += !Nearest(s, std::sin(double(y))) + !Nearest(c, std::cos(double(y)));
    }
  }
  BOOST_TEST(bad == 0u);
  float s, c;
  fmath::SinCos(0.0f, &s, &c);
  BOOST_TEST((s == 0.0f && c == 1.0f));
  fmath::SinCos(std::numeric_limits<float>::infinity(), &s, &c);
  BOOST_TEST((std::isnan(s) && std::isnan(c)));
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::kernels
