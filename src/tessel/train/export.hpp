#pragma once
// `tessel export`: publishing moved off the trainer. A standalone job consolidates a
// sharded checkpoint (verified as for a resume) into
//   OUT/model.safetensors   every parameter, in the model's order, one file
//   OUT/config.toml         the resolved run config of the checkpoint
//   OUT/tokenizer/          the tokenizer generate decodes with, where there is one: the
//                           run's copy, else its data.path's (model_tokenizer; refused as
//                           generate refuses it: data changed since the run, or not found
//                           from here; a BPE vocabulary's vocab.json and merges.txt, and
//                           tokenizer.json)
// readable by other tools (the safetensors format: safetensors.hpp).
#include <cstdint>
#include <string>

namespace tessel::train {

// The export's weights file, in OUT.
inline constexpr const char* kExportModelFile = "model.safetensors";

struct ExportResult {
  std::string checkpoint;  // the checkpoint directory that was exported
  int64_t step = 0;
  int64_t tensors = 0;
  uint64_t bytes = 0;      // of model.safetensors
  bool tokenizer = false;  // OUT/tokenizer/ was written
};

// `checkpoint` is a checkpoint directory (step-N) or a run directory (its newest checkpoint
// that verifies). InputError naming the file on a damaged checkpoint, and naming the path for
// an `out_dir` that is not an earlier export (a run's or a data set's directory, a user's file
// under an export's name), before anything there is written or removed.
ExportResult export_checkpoint(const std::string& checkpoint, const std::string& out_dir);

}  // namespace tessel::train
