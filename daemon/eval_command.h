// `flashd eval`: the forward pass of a model directory on given token ids, logits and layer
// streams written as .npy or safetensors (see PrintEvalHelp in eval_command.cc).
#pragma once

#include <string>
#include <vector>

namespace flashd::daemon {

// Returns the process exit code: 0, 1 (the run failed), 2 (bad usage).
int EvalCommand(const std::vector<std::string>& args);

}  // namespace flashd::daemon
