#pragma once
// Built-in text corpora, each a list of documents. Every document is non-empty; except for
// "jsonl:PATH" it is a sequence of lines, each ending in '\n'.
//
//  - "bible": the King James Bible from the Debian package bible-kjv (`bible
//    gen1:1-rev22:21`), one document per chapter (1189). A document is the chapter heading
//    ("Genesis 1") then one line per verse led by its number ("1 In the beginning God created
//    the heaven and the earth."); verses the program wraps are joined back into one line.
//  - "fortunes": every fortune file of the Debian package fortunes
//    (/usr/share/games/fortunes, files in name order, skipping *.dat, *.u8 and directories),
//    one document per fortune (fortunes are separated by lines holding only "%").
//  - "file:PATH": a UTF-8 text file, one document per paragraph: a run of non-blank lines,
//    paragraphs separated by one or more blank (empty or whitespace-only) lines.
//  - "jsonl:PATH": JSON Lines, one document per line: the "text" string of the line's object
//    (the layout of exported Hugging Face data sets; other keys are ignored), exactly as given:
//    it may hold blank lines and need not end in '\n'. Empty texts and blank lines are skipped.
//
// A missing package or file is an InputError that names it (scripts/setup.sh installs the
// packages).
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

std::vector<std::string> load_corpus(const std::string& name);

// Calls f(line) for each line of text, without its '\n' or a trailing '\r' (the last line
// need not end in '\n').
template <class F>
void for_each_line(std::string_view text, F&& f) {
  while (!text.empty()) {
    const size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(line);
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
  }
}

// The bytes of the file at `path`; InputError naming it when it is missing, a directory or
// cannot be read.
std::string read_file(const std::string& path);

// read_file's text without a leading UTF-8 byte-order mark (an editor's marker, not text):
// InputError naming the line of the first byte that is not valid UTF-8.
std::string read_utf8_file(const std::string& path);

// Byte offset of the first invalid UTF-8 sequence of `s` (overlong forms, surrogates and code
// points past U+10FFFF included), or npos.
size_t first_invalid_utf8(std::string_view s);

// The text of the file a "KIND:PATH" corpus names ("file", "chat"), as read_utf8_file:
// InputError naming the corpus for a missing file or a directory.
std::string read_corpus_file(const std::string& path, const std::string& kind);

// The parsers behind load_corpus, for text already in memory. `source` names the text in
// error messages.
// Output of the `bible` program -> one document per chapter.
std::vector<std::string> parse_bible(std::string_view text, const std::string& source);
// A fortune file -> one document per fortune.
std::vector<std::string> parse_fortunes(std::string_view text);
// Plain text -> one document per blank-line-separated paragraph.
std::vector<std::string> parse_paragraphs(std::string_view text);
// JSON Lines -> one document per line's non-empty "text"; InputError naming the line for a
// line that is not an object with a "text" string.
std::vector<std::string> parse_text_jsonl(std::string_view text, const std::string& source);

}  // namespace tessel::data
