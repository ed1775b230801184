// Helpers every kind of test uses: a private temporary directory, running a shell command, a
// substring check.
#pragma once

#include <filesystem>
#include <string>

namespace flashd::testing {

// A fresh directory under the system temp dir, removed with the object.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// True when `s` contains `part`.
bool Contains(const std::string& s, const std::string& part);

// What a shell command printed on stdout and its exit code (add "2>&1" to capture stderr too).
struct CommandResult {
  int code = -1;
  std::string out;
};
CommandResult RunCommand(const std::string& command);

}  // namespace flashd::testing
