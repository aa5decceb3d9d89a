#include "tessel/data/bpe_tokenizer.hpp"

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <queue>

#include "tessel/core/error.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/data/json_lines.hpp"

namespace tessel::data {

namespace {

// GPT-2's map of bytes to code points (bpe_byte_symbol): the other 68 bytes (controls, space,
// 0x7F-0xA0, 0xAD) take 256, 257, ..., so every token is printable text without spaces.
const std::array<UChar32, 256>& byte_code_points() {
  static const std::array<UChar32, 256> table = [] {
    std::array<UChar32, 256> t{};
    UChar32 next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[size_t(b)] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

// A token's bytes: each byte symbol mapped back; other characters (in tokens added by hand, such
// as the specials of newer vocabularies) stand for their own UTF-8.
std::string bytes_of_token(const std::string& token) {
  static const std::vector<int> byte_of_code_point = [] {
    std::vector<int> inverse(512, -1);
    for (int b = 0; b < 256; ++b) inverse[size_t(byte_code_points()[size_t(b)])] = b;
    return inverse;
  }();
  std::string bytes;
  const auto* s = reinterpret_cast<const uint8_t*>(token.data());
  const auto n = int32_t(token.size());
  for (int32_t i = 0; i < n;) {
    const int32_t start = i;
    UChar32 c;
    U8_NEXT(s, i, n, c);
    if (c >= 0 && c < 512 && byte_of_code_point[size_t(c)] >= 0)
      bytes.push_back(char(byte_of_code_point[size_t(c)]));
    else
      bytes.append(token, size_t(start), size_t(i - start));
  }
  return bytes;
}

// A token in an error message: escaped (a NUL would end the message) and at most this long
// (a token of megabytes would bury the message).
constexpr size_t kQuotedTokenBytes = 80;
std::string quote_token(std::string_view token) {
  return json_quote(token, kQuotedTokenBytes);
}

enum class CharClass : uint8_t { letter, number, space, other };

CharClass classify(UChar32 c) {
  const uint32_t category = U_GET_GC_MASK(c);
  if (category & U_GC_L_MASK) return CharClass::letter;
  if (category & U_GC_N_MASK) return CharClass::number;
  if (u_isUWhiteSpace(c)) return CharClass::space;
  return CharClass::other;
}

}  // namespace

std::string bpe_byte_symbol(int b) {
  char buf[U8_MAX_LENGTH];
  int32_t n = 0;
  U8_APPEND_UNSAFE(buf, n, byte_code_points()[size_t(b)]);
  return std::string(buf, size_t(n));
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  // Code points, their byte offsets (one past the end too) and classes.
  std::vector<UChar32> cp;
  std::vector<size_t> offset;
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const auto n_bytes = int64_t(text.size());
  for (int64_t i = 0; i < n_bytes;) {
    offset.push_back(size_t(i));
    UChar32 c;
    U8_NEXT(s, i, n_bytes, c);
    if (c < 0) input_error("text is not valid UTF-8 (at byte ", offset.back(), ")");
    cp.push_back(c);
  }
  offset.push_back(text.size());
  const size_t n = cp.size();
  std::vector<CharClass> cls(n);
  for (size_t i = 0; i < n; ++i) cls[i] = classify(cp[i]);
  auto run_end = [&](size_t i, CharClass k) {
    while (i < n && cls[i] == k) ++i;
    return i;
  };
  auto at = [&](size_t i, UChar32 c) { return i < n && cp[i] == c; };

  std::vector<std::string_view> pieces;
  for (size_t p = 0; p < n;) {
    size_t end = p;
    if (cp[p] == '\'' && (at(p + 1, 's') || at(p + 1, 't') || at(p + 1, 'm') || at(p + 1, 'd'))) {
      end = p + 2;
    } else if (cp[p] == '\'' &&
               ((at(p + 1, 'r') && at(p + 2, 'e')) || (at(p + 1, 'v') && at(p + 2, 'e')) ||
                (at(p + 1, 'l') && at(p + 2, 'l')))) {
      end = p + 3;
    } else {
      // " ?X+" for letters, numbers and the rest: one leading space joins the run.
      const size_t body = cp[p] == ' ' ? p + 1 : p;
      if (body < n && cls[body] != CharClass::space) {
        end = run_end(body, cls[body]);
      } else {
        // White space: a run followed by text leaves its last character to that text
        // ("\s+(?!\S)"), except a run of one ("\s+").
        const size_t run = run_end(p, CharClass::space);
        end = run == n || run - p == 1 ? run : run - 1;
      }
    }
    pieces.push_back(text.substr(offset[p], offset[end] - offset[p]));
    p = end;
  }
  return pieces;
}

void bpe_merge_pair(std::vector<int32_t>& ids, uint64_t pair, int32_t made) {
  size_t out = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i + 1 < ids.size() && bpe_pair_key(ids[i], ids[i + 1]) == pair) {
      ids[out++] = made;
      ++i;
    } else {
      ids[out++] = ids[i];
    }
  }
  ids.resize(out);
}

std::vector<int32_t> bpe_merge(std::vector<int32_t> ids, const BpeMergeTable& merges) {
  const auto n = int32_t(ids.size());
  if (n < 2) return ids;
  // A doubly linked list over the symbols; a merge keeps its left node.
  std::vector<int32_t> next(static_cast<size_t>(n)), prev(static_cast<size_t>(n));
  std::vector<uint8_t> alive(size_t(n), 1);
  for (int32_t i = 0; i < n; ++i) next[size_t(i)] = i + 1, prev[size_t(i)] = i - 1;
  struct Candidate {
    int32_t rank, pos, left, right, made;
  };
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> heap(later);
  auto push = [&](int32_t p) {
    const int32_t q = next[size_t(p)];
    if (q >= n) return;
    const auto it = merges.find(bpe_pair_key(ids[size_t(p)], ids[size_t(q)]));
    if (it != merges.end())
      heap.push({it->second.rank, p, ids[size_t(p)], ids[size_t(q)], it->second.id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    // Stale when either symbol has changed since the pair was seen: a merged token is new,
    // so it never equals the id recorded.
    const int32_t q = next[size_t(c.pos)];
    if (!alive[size_t(c.pos)] || ids[size_t(c.pos)] != c.left || q >= n ||
        ids[size_t(q)] != c.right)
      continue;
    ids[size_t(c.pos)] = c.made;
    alive[size_t(q)] = 0;
    next[size_t(c.pos)] = next[size_t(q)];
    if (next[size_t(q)] < n) prev[size_t(next[size_t(q)])] = c.pos;
    if (prev[size_t(c.pos)] >= 0) push(prev[size_t(c.pos)]);
    push(c.pos);
  }
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n; i = next[size_t(i)]) out.push_back(ids[size_t(i)]);
  return out;
}

namespace naive {

std::vector<int32_t> bpe_merge(std::vector<int32_t> ids, const BpeMergeTable& merges) {
  while (ids.size() >= 2) {
    const BpeMerge* best = nullptr;
    uint64_t best_pair = 0;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const uint64_t pair = bpe_pair_key(ids[i], ids[i + 1]);
      const auto it = merges.find(pair);
      if (it != merges.end() && (!best || it->second.rank < best->rank))
        best = &it->second, best_pair = pair;
    }
    if (!best) break;
    bpe_merge_pair(ids, best_pair, best->id);
  }
  return ids;
}

}  // namespace naive

BpeTokenizer::BpeTokenizer(const std::string& vocab_json, const std::string& merges_txt) {
  const nlohmann::json vocab = parse_json(read_file(vocab_json), vocab_json);
  if (!vocab.is_object() || vocab.empty())
    input_error(vocab_json, ": expected a JSON object of tokens and their ids");
  std::unordered_map<std::string, int32_t> id_of;
  std::vector<std::pair<int32_t, std::string>> token_bytes;  // each token's id and bytes
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= INT32_MAX)
      input_error(vocab_json, ": token ", quote_token(token), " has id ", id.dump(),
                  "; ids are integers in [0, 2^31 - 1)");
    if (token.empty())  // it would decode to nothing
      input_error(vocab_json, ": token \"\" (id ", id.get<int32_t>(), ") is empty");
    id_of[token] = id.get<int32_t>();
    token_bytes.emplace_back(id.get<int32_t>(), bytes_of_token(token));
    vocab_size_ = std::max(vocab_size_, id.get<int32_t>() + 1);
  }
  // Ids index dense tables: a vocabulary with far more ids than tokens is refused (a stray
  // id near 2^31 would otherwise take all memory).
  if (int64_t(vocab_size_) > int64_t(id_of.size()) + 65536)
    input_error(vocab_json, ": ids up to ", vocab_size_ - 1, " for ", id_of.size(),
                " tokens; a vocabulary with gaps of more than 65536 ids is not supported");
  bytes_of_id_.resize(size_t(vocab_size_));
  has_token_.assign(size_t(vocab_size_), false);
  for (auto& [id, bytes] : token_bytes) {
    if (has_token_[size_t(id)]) input_error(vocab_json, ": id ", id, " belongs to two tokens");
    has_token_[size_t(id)] = true;
    bytes_of_id_[size_t(id)] = std::move(bytes);
  }
  if (const auto it = id_of.find("<|endoftext|>"); it != id_of.end()) end_of_text_ = it->second;

  std::vector<bool> made(size_t(vocab_size_), false);  // byte symbols, then merge results
  for (int b = 0; b < 256; ++b) {
    const std::string symbol = bpe_byte_symbol(b);
    const auto it = id_of.find(symbol);
    if (it == id_of.end())
      input_error(vocab_json, ": no token for byte ", b, " (its symbol \"", symbol,
                  "\"); a byte-level BPE vocabulary has all 256");
    byte_id_[b] = it->second;
    made[size_t(it->second)] = true;
  }

  const std::string merges_text = read_utf8_file(merges_txt);
  int64_t line_number = 0;
  int32_t rank = 0;
  for_each_line(merges_text, [&](std::string_view line) {
    ++line_number;
    if (line.empty() || (line_number == 1 && line.starts_with("#version"))) return;
    const size_t space = line.find(' ');
    if (space == 0 || space == std::string_view::npos || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos)
      input_error(merges_txt, ":", line_number, ": expected two tokens separated by one space");
    const std::string left(line.substr(0, space)), right(line.substr(space + 1));
    int32_t parts[2];
    for (int k = 0; k < 2; ++k) {
      const std::string& part = k == 0 ? left : right;
      const auto it = id_of.find(part);
      if (it == id_of.end() || !made[size_t(it->second)])
        input_error(merges_txt, ":", line_number, ": ", quote_token(part), " is ",
                    it == id_of.end() ? "not in " + vocab_json
                                      : std::string("made by no byte or earlier merge"));
      parts[k] = it->second;
    }
    const auto it = id_of.find(left + right);
    if (it == id_of.end())
      input_error(merges_txt, ":", line_number, ": the merged token ", quote_token(left + right),
                  " is not in ", vocab_json);
    if (made[size_t(it->second)])
      input_error(merges_txt, ":", line_number, ": ", quote_token(left + right),
                  " is a byte symbol or was made by an earlier merge");
    made[size_t(it->second)] = true;
    merges_[bpe_pair_key(parts[0], parts[1])] = {rank++, it->second};
  });
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_directory(const std::string& dir) {
  return std::make_unique<BpeTokenizer>(dir + "/" + kBpeFiles[0], dir + "/" + kBpeFiles[1]);
}

void BpeTokenizer::append_piece(std::string_view piece, std::vector<int32_t>& out) const {
  std::string key(piece);
  auto cached = piece_cache_.find(key);
  if (cached == piece_cache_.end()) {
    std::vector<int32_t> ids(piece.size());
    for (size_t i = 0; i < piece.size(); ++i)
      ids[i] = byte_id_[static_cast<unsigned char>(piece[i])];
    if (piece_cache_.size() >= (1u << 20)) piece_cache_.clear();  // bounded memory
    cached = piece_cache_.emplace(std::move(key), bpe_merge(std::move(ids), merges_)).first;
  }
  out.insert(out.end(), cached->second.begin(), cached->second.end());
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  for (std::string_view piece : gpt2_pretokenize(text)) append_piece(piece, ids);
  return ids;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size_)
      input_error("BPE tokenizer: token id ", id, " at position ", i, " is outside [0, ",
                  vocab_size_, ")");
    if (has_token_[size_t(id)])
      text += bytes_of_id_[size_t(id)];
    else
      text += "\xEF\xBF\xBD";  // U+FFFD: an id of no token
  }
  return text;
}

}  // namespace tessel::data
