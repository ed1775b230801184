// Status and StatusOr<T>: errors as values, shared by every flashd target.
//
// A Status is either OK or carries a code and a one-line message meant for a person: it names the
// file, key, tensor or field at fault. Library exceptions are caught where the library is called
// and turned into a Status; nothing on a request path throws past its own module.
#pragma once

#include <cassert>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace flashd {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // The caller's input is wrong (config value, request field, file contents).
  kNotFound,
  kAlreadyExists,
  kFailedPrecondition,  // The system is not in a state that allows the call (e.g. a daemon runs).
  kUnavailable,         // Try again later (model still loading, disk full).
  kResourceExhausted,
  kDataLoss,  // Stored data is corrupt or truncated.
  kIoError,
  kInternal,
};

std::string_view StatusCodeName(StatusCode code);
std::ostream& operator<<(std::ostream& os, StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // "InvalidArgument: message", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: message"; OK stays OK.
  Status WithContext(std::string_view context) const;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& status);

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// Holds either a T or a non-OK Status. Accessing the value of an error is a programmer error.
template <typename T>
class [[nodiscard]] StatusOr {
 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design.
    assert(!status_.ok() && "StatusOr constructed from an OK status without a value");
    if (status_.ok()) status_ = Internal("StatusOr constructed from OK status without a value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design.

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace flashd

// Returns early from the enclosing function when `expr` (a Status) is not OK.
#define FLASHD_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::flashd::Status flashd_status_ = (expr);        \
    if (!flashd_status_.ok()) return flashd_status_; \
  } while (0)

#define FLASHD_CONCAT_INNER(a, b) a##b
#define FLASHD_CONCAT(a, b) FLASHD_CONCAT_INNER(a, b)

// Declares `lhs` from a StatusOr expression, returning its Status early on error.
#define FLASHD_ASSIGN_OR_RETURN(lhs, expr) \
  FLASHD_ASSIGN_OR_RETURN_IMPL(FLASHD_CONCAT(flashd_statusor_, __LINE__), lhs, expr)
#define FLASHD_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
