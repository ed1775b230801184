#include "config/status.h"

#include <boost/test/unit_test.hpp>
#include <memory>

namespace flashd {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("odd: " + std::to_string(x));
  return x / 2;
}

StatusOr<int> Quarter(int x) {
  FLASHD_ASSIGN_OR_RETURN(int h, Half(x));
  FLASHD_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckPositive(int x) {
  if (x <= 0) return FailedPrecondition("not positive");
  return Status::Ok();
}

Status BothPositive(int a, int b) {
  FLASHD_RETURN_IF_ERROR(CheckPositive(a));
  FLASHD_RETURN_IF_ERROR(CheckPositive(b));
  return Status::Ok();
}

BOOST_AUTO_TEST_SUITE(status)

BOOST_AUTO_TEST_CASE(ok_and_error) {
  Status ok;
  BOOST_TEST(ok.ok());
  BOOST_TEST(ok.ToString() == "OK");
  Status bad = NotFound("model.dir: no config.json");
  BOOST_TEST(!bad.ok());
  BOOST_TEST(bad.code() == StatusCode::kNotFound);
  BOOST_TEST(bad.ToString() == "NotFound: model.dir: no config.json");
}

BOOST_AUTO_TEST_CASE(with_context_prefixes_message_and_keeps_code) {
  Status s = DataLoss("bad crc").WithContext("block 7");
  BOOST_TEST(s.message() == "block 7: bad crc");
  BOOST_TEST(s.code() == StatusCode::kDataLoss);
  BOOST_TEST(Status::Ok().WithContext("x").ok());
}

BOOST_AUTO_TEST_CASE(status_or_propagates_first_error) {
  BOOST_TEST(*Quarter(8) == 2);
  StatusOr<int> r = Quarter(6);  // 6 -> 3 -> odd
  BOOST_TEST(!r.ok());
  BOOST_TEST(r.status().message() == "odd: 3");
  BOOST_TEST(Quarter(5).status().message() == "odd: 5");
}

BOOST_AUTO_TEST_CASE(return_if_error_stops_at_first_failure) {
  BOOST_TEST(BothPositive(1, 2).ok());
  BOOST_TEST(BothPositive(1, -2).code() == StatusCode::kFailedPrecondition);
}

BOOST_AUTO_TEST_CASE(status_or_holds_move_only_values) {
  StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(42);
  BOOST_REQUIRE(p.ok());
  std::unique_ptr<int> owned = std::move(p).value();
  BOOST_TEST(*owned == 42);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd
