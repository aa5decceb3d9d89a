#pragma once
// metrics.jsonl: one JSON object per line, appended and flushed as it happens, so
// a crash loses at most the line being written. On resume from step k the lines of
// steps after k (training that the resumed run will redo) are dropped first.
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tessel::train {

class MetricsLog {
 public:
  // Opens `path` for appending; keeps only records with "step" <= keep_through_step
  // (pass -1 to start a new file).
  MetricsLog(const std::string& path, int64_t keep_through_step);
  void write(const nlohmann::json& record);

 private:
  std::string path_;
  std::ofstream out_;
};

// One record of a JSON-lines file and its 1-based line number.
struct JsonLine {
  int64_t line = 0;
  nlohmann::json record;
};
// The records of a JSON-lines file the trainer appends to (metrics.jsonl, the ETT attempt logs),
// blank lines left out: the reading rule of the reports (ett-report, simulate). A line that is no
// JSON object (cut, NaN) is an InputError naming path:line ("malformed <what> record"), except the
// last line, which a crash can leave cut short: it is left out and `cut_line` set. InputError
// naming the file when it cannot be read.
std::vector<JsonLine> read_json_lines(const std::string& path, const char* what, bool& cut_line);

// FLOPs of one token's forward and backward (PaLM appendix B, as in the ETT spec):
// 6 * matmul parameters + 12 * layers * heads * head_dim * seq_len.
double flops_per_token(int64_t matmul_parameters, int64_t layers, int64_t heads, int64_t head_dim,
                       int64_t seq_len);
// What train.recompute = blocks adds per token (HFU counts it, MFU does not): every block's
// forward runs again, 2 * block matmul parameters + 4 * layers * heads * head_dim * seq_len
// (the head, outside the blocks, is not recomputed).
double recompute_flops_per_token(int64_t block_matmul_parameters, int64_t layers, int64_t heads,
                                 int64_t head_dim, int64_t seq_len);

}  // namespace tessel::train
