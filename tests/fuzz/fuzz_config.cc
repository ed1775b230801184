// The YAML configuration: any text gives a config or an error naming file, line and key.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  flashd::StatusOr<flashd::Config> c = flashd::ParseConfig(text, "fuzz.yaml");
  if (c.ok()) (void)c->Where("server.listen");
  return 0;
}
