#include "tessel/data/bpe_trainer.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/data/bpe_tokenizer.hpp"

namespace tessel::data {

namespace {

struct Piece {
  std::vector<int32_t> ids;
  int64_t count;
};

// The distinct pieces of the documents as byte ids, with their counts, in byte order of the
// piece (so that learning does not depend on hash order).
std::vector<Piece> count_pieces(const std::vector<std::string>& documents) {
  std::map<std::string_view, int64_t> counts;
  for (const std::string& doc : documents)
    for (std::string_view piece : gpt2_pretokenize(doc)) ++counts[piece];
  std::vector<Piece> pieces;
  pieces.reserve(counts.size());
  for (const auto& [text, count] : counts) {
    Piece p{std::vector<int32_t>(text.size()), count};
    for (size_t i = 0; i < text.size(); ++i) p.ids[i] = static_cast<unsigned char>(text[i]);
    pieces.push_back(std::move(p));
  }
  return pieces;
}

// Token strings (the byte symbols first) and which strings are tokens.
struct Vocabulary {
  Vocabulary() {
    for (int b = 0; b < 256; ++b) add(bpe_byte_symbol(b));
  }
  int32_t add(std::string token) {
    known.insert(token);
    tokens.push_back(std::move(token));
    return int32_t(tokens.size() - 1);
  }
  std::string joined(uint64_t pair) const {
    return tokens[size_t(pair >> 32)] + tokens[size_t(uint32_t(pair))];
  }
  std::vector<std::string> tokens;
  std::unordered_set<std::string> known;
};

void check_merges(int64_t merges) {
  if (merges < 0) input_error("train-bpe: the number of merges must be >= 0, got ", merges);
}

}  // namespace

std::vector<BpeMergeStrings> learn_bpe_merges(const std::vector<std::string>& documents,
                                              int64_t merges) {
  check_merges(merges);
  std::vector<Piece> pieces = count_pieces(documents);
  Vocabulary vocab;
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pieces_with;  // may hold stale entries
  // Max-heap of (count, pair), lowest pair first on equal counts; an entry is stale once its
  // count no longer matches pair_count.
  using Entry = std::pair<int64_t, uint64_t>;
  auto lower = [](const Entry& a, const Entry& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(lower)> heap(lower);
  auto count_pairs = [&](int32_t p, int64_t sign, std::unordered_set<uint64_t>& changed) {
    const Piece& piece = pieces[size_t(p)];
    for (size_t i = 0; i + 1 < piece.ids.size(); ++i) {
      const uint64_t pair = bpe_pair_key(piece.ids[i], piece.ids[i + 1]);
      pair_count[pair] += sign * piece.count;
      if (sign > 0) pieces_with[pair].push_back(p);
      changed.insert(pair);
    }
  };
  std::unordered_set<uint64_t> changed;
  for (int32_t p = 0; p < int32_t(pieces.size()); ++p) count_pairs(p, +1, changed);
  for (uint64_t pair : changed) heap.push({pair_count[pair], pair});

  std::vector<BpeMergeStrings> learned;
  std::vector<int64_t> merged_in(pieces.size(), -1);  // the last merge that visited a piece
  while (int64_t(learned.size()) < merges && !heap.empty()) {
    const auto [count, pair] = heap.top();
    heap.pop();
    if (count != pair_count[pair]) continue;  // stale
    if (count < 2) break;
    std::string token = vocab.joined(pair);
    // Each merge must make a new token (BpeTokenizer's rule): skipped now and whenever its
    // count changes and brings it back to the top.
    if (vocab.known.contains(token)) continue;
    const auto made = vocab.add(token);
    learned.emplace_back(vocab.tokens[size_t(pair >> 32)], vocab.tokens[size_t(uint32_t(pair))]);
    changed.clear();
    for (int32_t p : std::exchange(pieces_with[pair], {})) {
      if (merged_in[size_t(p)] == int64_t(learned.size())) continue;  // listed twice: done
      merged_in[size_t(p)] = int64_t(learned.size());
      count_pairs(p, -1, changed);
      bpe_merge_pair(pieces[size_t(p)].ids, pair, made);
      count_pairs(p, +1, changed);
    }
    for (uint64_t c : changed)
      if (pair_count[c] > 0) heap.push({pair_count[c], c});
  }
  return learned;
}

namespace naive {

std::vector<BpeMergeStrings> learn_bpe_merges(const std::vector<std::string>& documents,
                                              int64_t merges) {
  check_merges(merges);
  std::vector<Piece> pieces = count_pieces(documents);
  Vocabulary vocab;
  std::unordered_set<uint64_t> banned;  // pairs whose joined string is already a token
  std::vector<BpeMergeStrings> learned;
  while (int64_t(learned.size()) < merges) {
    std::map<uint64_t, int64_t> counts;  // ordered: the first of the largest is the lowest pair
    for (const Piece& piece : pieces)
      for (size_t i = 0; i + 1 < piece.ids.size(); ++i)
        counts[bpe_pair_key(piece.ids[i], piece.ids[i + 1])] += piece.count;
    uint64_t best = 0;
    int64_t best_count = 0;
    for (const auto& [pair, count] : counts)
      if (count > best_count && !banned.contains(pair)) best = pair, best_count = count;
    if (best_count < 2) break;
    std::string token = vocab.joined(best);
    if (vocab.known.contains(token)) {
      banned.insert(best);
      continue;
    }
    const auto made = vocab.add(token);
    learned.emplace_back(vocab.tokens[size_t(best >> 32)], vocab.tokens[size_t(uint32_t(best))]);
    for (Piece& piece : pieces) bpe_merge_pair(piece.ids, best, made);
  }
  return learned;
}

}  // namespace naive

int64_t write_bpe_files(const std::string& dir, const std::vector<BpeMergeStrings>& merges) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) input_error(dir, ": cannot create the tokenizer directory: ", ec.message());
  nlohmann::ordered_json vocab = nlohmann::ordered_json::object();
  for (int b = 0; b < 256; ++b) vocab[bpe_byte_symbol(b)] = b;
  std::string lines = "#version: 0.2\n";
  int64_t id = 256;
  for (const auto& [left, right] : merges) {
    lines += left + ' ' + right + '\n';
    vocab[left + right] = id++;
  }
  vocab["<|endoftext|>"] = id++;
  write_file_atomically(dir + "/" + kBpeFiles[1], lines);
  write_file_atomically(dir + "/" + kBpeFiles[0], vocab.dump() + "\n");
  return id;
}

}  // namespace tessel::data
