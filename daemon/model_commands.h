// The model subcommands of the flashd binary: mkmodel and model-info.
#pragma once

#include <string>
#include <vector>

namespace flashd::daemon {

int MkModelCommand(const std::vector<std::string>& args);
int ModelInfoCommand(const std::vector<std::string>& args);

}  // namespace flashd::daemon
