#include "tessel/data/corpus.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tessel/core/error.hpp"
#include "tessel/data/json_lines.hpp"

namespace tessel::data {

namespace fs = std::filesystem;

namespace {

constexpr const char* kBibleProgram = "/usr/bin/bible";
constexpr const char* kBibleRange = "gen1:1-rev22:21";
constexpr const char* kFortuneDir = "/usr/share/games/fortunes";

[[noreturn]] void missing_package(const std::string& corpus, const std::string& package,
                                  const std::string& what) {
  input_error("corpus \"", corpus, "\" needs the Debian package ", package, " (", what,
              "); install it with scripts/setup.sh or `apt-get install ", package, "`");
}

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits text into documents at separator lines; a document is its lines each ending in '\n',
// without leading or trailing blank lines. Empty documents are dropped.
template <class IsSeparator>
std::vector<std::string> split_documents(std::string_view text, IsSeparator&& is_separator) {
  std::vector<std::string> docs;
  std::string doc;
  size_t pending_blank = 0;  // blank lines held back until a non-blank line follows
  auto flush = [&] {
    if (!doc.empty()) docs.push_back(std::move(doc));
    doc.clear();
    pending_blank = 0;
  };
  for_each_line(text, [&](std::string_view line) {
    if (is_separator(line)) return flush();
    if (is_blank(line)) {
      if (!doc.empty()) ++pending_blank;
      return;
    }
    doc.append(pending_blank, '\n');
    pending_blank = 0;
    doc.append(line);
    doc.push_back('\n');
  });
  flush();
  return docs;
}

std::vector<std::string> load_bible() {
  if (::access(kBibleProgram, X_OK) != 0)
    missing_package("bible", "bible-kjv", std::string(kBibleProgram) + " not found");
  const std::string command = std::string(kBibleProgram) + " " + kBibleRange;
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) input_error("corpus \"bible\": cannot run `", command, "`");
  std::string text;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) text.append(buf, n);
  const int status = ::pclose(pipe);
  if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    input_error("corpus \"bible\": `", command, "` failed (exit status ",
                WIFEXITED(status) ? WEXITSTATUS(status) : status,
                "); reinstall the Debian package bible-kjv");
  auto docs = parse_bible(text, "`" + command + "`");
  if (docs.empty())
    input_error("corpus \"bible\": `", command,
                "` printed no chapters; reinstall the Debian package bible-kjv");
  return docs;
}

std::vector<std::string> load_fortunes() {
  if (!fs::is_directory(kFortuneDir))
    missing_package("fortunes", "fortunes", std::string(kFortuneDir) + " not found");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(kFortuneDir)) {
    // *.u8 are symlinks to the plain files; off/ holds the offensive set, left out.
    const auto ext = entry.path().extension();
    if (entry.is_symlink() || !entry.is_regular_file() || ext == ".dat" || ext == ".u8") continue;
    files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> docs;
  for (const auto& file : files) {
    auto part = parse_fortunes(read_file(file.string()));
    docs.insert(docs.end(), std::make_move_iterator(part.begin()),
                std::make_move_iterator(part.end()));
  }
  if (docs.empty())
    missing_package("fortunes", "fortunes", std::string(kFortuneDir) + " holds no fortunes");
  return docs;
}

std::vector<std::string> load_text_file(const std::string& path) {
  auto docs = parse_paragraphs(read_corpus_file(path, "file"));
  if (docs.empty()) input_error(path, ": no documents (the file is empty or blank)");
  return docs;
}

std::vector<std::string> load_jsonl_file(const std::string& path) {
  auto docs = parse_text_jsonl(read_corpus_file(path, "jsonl"), path);
  if (docs.empty()) input_error(path, ": no documents (no line has a non-empty \"text\")");
  return docs;
}

}  // namespace

size_t first_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    if (len == 0 || i + len > s.size()) return i;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (size_t k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return i;
      cp = (cp << 6) | (cc & 0x3f);
    }
    // Reject overlong forms, UTF-16 surrogates and code points past U+10FFFF.
    static constexpr uint32_t kMinCodePoint[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinCodePoint[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string read_file(const std::string& path) {
  // Checked first: an ifstream opens a directory and reads it as empty.
  std::error_code ec;
  const fs::file_type type = fs::status(path, ec).type();
  if (type == fs::file_type::not_found) input_error(path, ": no such file or directory");
  if (type == fs::file_type::directory) input_error(path, ": is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) input_error(path, ": cannot read file");
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) input_error(path, ": read failed");
  return std::move(os).str();
}

std::string read_corpus_file(const std::string& path, const std::string& kind) {
  if (!fs::exists(path)) input_error(path, ": no such file (corpus \"", kind, ":", path, "\")");
  if (fs::is_directory(path))
    input_error(path, ": is a directory; corpus \"", kind, ":PATH\" takes one file");
  return read_utf8_file(path);
}

std::string read_utf8_file(const std::string& path) {
  std::string text = read_file(path);
  const size_t bom = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;
  text.erase(0, bom);
  if (size_t bad = first_invalid_utf8(text); bad != std::string::npos)
    input_error(path, ":", 1 + std::count(text.begin(), text.begin() + int64_t(bad), '\n'),
                ": not valid UTF-8 text (at byte ", bom + bad, " of the file)");
  return text;
}

std::vector<std::string> parse_bible(std::string_view text, const std::string& source) {
  // Layout: a blank line, a heading ("Genesis 1", "Song of Solomon 3"), a blank line, then
  // verses "  N text" that may wrap onto unindented continuation lines.
  std::vector<std::string> docs;
  std::string verse;
  bool previous_blank = true;
  size_t line_no = 0;
  auto flush_verse = [&] {
    if (verse.empty()) return;
    docs.back().append(verse);
    docs.back().push_back('\n');
    verse.clear();
  };
  for_each_line(text, [&](std::string_view line) {
    ++line_no;
    if (is_blank(line)) {  // blank lines only frame headings
      previous_blank = true;
      return;
    }
    const bool indented = std::isspace(static_cast<unsigned char>(line.front()));
    if (!indented && previous_blank) {
      flush_verse();
      docs.emplace_back(trim(line));
      docs.back().push_back('\n');
    } else if (docs.empty()) {
      input_error(source, ": line ", line_no, ": verse text before the first chapter heading");
    } else if (indented) {
      flush_verse();
      verse = trim(line);
    } else {
      verse.push_back(' ');
      verse.append(trim(line));
    }
    previous_blank = false;
  });
  if (!docs.empty()) flush_verse();
  return docs;
}

std::vector<std::string> parse_fortunes(std::string_view text) {
  return split_documents(text, [](std::string_view line) { return line == "%"; });
}

std::vector<std::string> parse_paragraphs(std::string_view text) {
  return split_documents(text, is_blank);
}

std::vector<std::string> parse_text_jsonl(std::string_view text, const std::string& source) {
  std::vector<std::string> docs;
  for_each_json_line(text, source, [&](const nlohmann::json& line, const std::string& where) {
    if (!line.is_object() || !line.contains("text"))
      input_error(
          where, ": expected an object with a \"text\" string, got ",
          line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).substr(0, 80));
    if (!line["text"].is_string())
      input_error(where, ": \"text\" must be a string, got ", line["text"].type_name());
    if (!line["text"].get_ref<const std::string&>().empty())
      docs.push_back(line["text"].get<std::string>());
  });
  return docs;
}

std::vector<std::string> load_corpus(const std::string& name) {
  if (name == "bible") return load_bible();
  if (name == "fortunes") return load_fortunes();
  if (name.starts_with("file:") && name.size() > 5) return load_text_file(name.substr(5));
  if (name.starts_with("jsonl:") && name.size() > 6) return load_jsonl_file(name.substr(6));
  input_error("unknown corpus \"", name,
              "\" (expected bible, fortunes, file:PATH, jsonl:PATH or tokens:PATH; SFT: "
              "bible-quotes or chat:PATH)");
}

}  // namespace tessel::data
