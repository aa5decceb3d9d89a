#include "tessel/train/metrics.hpp"

#include <filesystem>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/train/checkpoint.hpp"

namespace tessel::train {

MetricsLog::MetricsLog(const std::string& path, int64_t keep_through_step) : path_(path) {
  std::string kept;
  if (keep_through_step >= 0 && std::filesystem::exists(path)) {
    std::ifstream in(path);
    int64_t number = 0;
    for (std::string line; std::getline(in, line);) {
      if (++number, line.empty()) continue;
      auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      const bool stepless = record.is_object() && !record.contains("step");
      if (!stepless && !(record.is_object() && record["step"].is_number_integer())) {
        // Cut short by a crash, or damaged: the history loses it, and says so.
        warn_on_stderr(path + ":" + std::to_string(number) + ": malformed metrics record dropped");
        continue;
      }
      if (stepless || record["step"].get<int64_t>() <= keep_through_step) kept += line + "\n";
    }
  }
  // Replace the file in one step: a crash here leaves the old history, never a cut one.
  write_file_atomically(path, kept);
  out_.open(path, std::ios::app);
  if (!out_) input_error(path, ": cannot open metrics file for writing");
}

void MetricsLog::write(const nlohmann::json& record) {
  out_ << record.dump() << "\n";
  out_.flush();
  if (!out_) input_error(path_, ": write failed (disk full?)");
}

std::vector<JsonLine> read_json_lines(const std::string& path, const char* what, bool& cut_line) {
  std::ifstream in(path);
  if (!in) input_error(path, ": cannot read");
  std::vector<std::pair<int64_t, std::string>> lines;
  int64_t number = 0;
  for (std::string line; std::getline(in, line);)
    if (++number, !line.empty()) lines.emplace_back(number, std::move(line));
  std::vector<JsonLine> records;
  for (size_t i = 0; i < lines.size(); ++i) {
    auto j = nlohmann::json::parse(lines[i].second, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) {  // also a discarded parse
      if (i + 1 == lines.size()) {
        cut_line = true;
        break;
      }
      input_error(path, ":", lines[i].first, ": malformed ", what, " record");
    }
    records.push_back({lines[i].first, std::move(j)});
  }
  return records;
}

double flops_per_token(int64_t matmul_parameters, int64_t layers, int64_t heads, int64_t head_dim,
                       int64_t seq_len) {
  return 6.0 * double(matmul_parameters) +
         12.0 * double(layers) * double(heads) * double(head_dim) * double(seq_len);
}

double recompute_flops_per_token(int64_t block_matmul_parameters, int64_t layers, int64_t heads,
                                 int64_t head_dim, int64_t seq_len) {
  return 2.0 * double(block_matmul_parameters) +
         4.0 * double(layers) * double(heads) * double(head_dim) * double(seq_len);
}

}  // namespace tessel::train
