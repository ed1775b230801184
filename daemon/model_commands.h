// The model subcommands of the flashd binary: mkmodel and model-info.
#pragma once

#include <string>
#include <vector>

namespace flashd::daemon {

int MkModelCommand(const std::vector<std::string>& args);
int ModelInfoCommand(const std::vector<std::string>& args);
// `flashd plan`: where the model's parts go on a machine (engine/placement_plan.h).
int PlanCommand(const std::vector<std::string>& args);

}  // namespace flashd::daemon

namespace flashd::daemon {

// `flashd tokenize --tokenizer FILE`: stdin text -> one JSON array of ids (no special tokens
// added; special-token text in the input is recognised, as the tokenizers library does).
int TokenizeCommand(const std::vector<std::string>& args);
// `flashd detokenize --tokenizer FILE`: a JSON array of ids on stdin -> their text on stdout.
int DetokenizeCommand(const std::vector<std::string>& args);

}  // namespace flashd::daemon
