/* SPDX-License-Identifier: MIT */
/* safetensors.c -- reading tensors from safetensors files: the header parsed strictly (its JSON by
 * a parser of its own, every offset checked against the file), then only the tensors asked for
 * read with pread and converted into a moe_tensor on any device.
 *
 * The file: 8 bytes, the header's length N (little-endian); N bytes of JSON, an object whose
 * members are the tensors ({"dtype", "shape", "data_offsets": [begin, end]}) and an optional
 * "__metadata__"; then the data, each tensor's bytes at [begin, end) counted from the end of the
 * header, row-major, little-endian. */
#define _POSIX_C_SOURCE 200809L /* pread */
#define _FILE_OFFSET_BITS 64     /* offsets past 2 GiB on 32-bit hosts too */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fp8_math.h"
#include "internal.h"

enum { MAX_DIMS = 8 };       /* the shape of moe_safetensors_info */
enum { MAX_DEPTH = 64 };     /* nesting of the values inside "__metadata__" */
enum { BLOCK = 128 };        /* the side of a block of an F8_E4M3 tensor's scale */
enum { CHUNK = 1 << 20 };    /* elements converted per read: a few MiB of buffers at most */
/* A header past this (100 MB, the format's own reader's limit) is not a checkpoint's, and
 * would only make the parser allocate for it. */
#define MAX_HEADER ((uint64_t)100000000)

/* The dtypes of the format and their element sizes.  Those with a reader in convert() are
 * marked readable; the others are listed so that their offsets are checked all the same. */
enum { ST_BF16, ST_F16, ST_F32, ST_E4M3, ST_OTHER };
static const struct st_dtype {
  const char *name;
  int size;
  int kind;
} dtypes[] = {
  {"BF16", 2, ST_BF16}, {"F16", 2, ST_F16}, {"F32", 4, ST_F32}, {"F8_E4M3", 1, ST_E4M3},
  {"F64", 8, ST_OTHER}, {"F8_E5M2", 1, ST_OTHER}, {"BOOL", 1, ST_OTHER}, {"U8", 1, ST_OTHER},
  {"I8", 1, ST_OTHER}, {"I16", 2, ST_OTHER}, {"U16", 2, ST_OTHER}, {"I32", 4, ST_OTHER},
  {"U32", 4, ST_OTHER}, {"I64", 8, ST_OTHER}, {"U64", 8, ST_OTHER}, {"F8_E8M0", 1, ST_OTHER}, {"C64", 8, ST_OTHER},
};
#define NDTYPES (sizeof dtypes / sizeof dtypes[0])
#define READABLE "BF16, F16, F32 and F8_E4M3"

struct entry {
  const char *name; /* in the file's arena */
  const struct st_dtype *dtype;
  int ndim;
  int64_t shape[MAX_DIMS];
  uint64_t begin, end; /* relative to the data */
  uint64_t numel;
  size_t at;           /* the header byte where its name starts, for messages */
};

struct moe_safetensors {
  int fd;
  char *path;
  uint64_t data_start, data_size;
  struct entry *entries; /* sorted by name */
  int count, cap;
  char *arena;           /* the decoded strings of the header */
};

/* ---- the header's JSON ---- */

typedef struct parser {
  moe_ctx *ctx;
  const char *path;
  const char *s; /* the header, n bytes (not NUL-terminated) */
  size_t n, pos;
  char *arena;   /* n + 1 bytes: a decoded string is never longer than its JSON */
  size_t used;
  int failed;
} parser;

/* Records "the header is malformed at byte B" (B counted from the file's start) and returns
 * MOE_ERR_IO; only the first failure of a parse is kept. */
static int bad(parser *p, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static int bad(parser *p, const char *fmt, ...) {
  if (p->failed) return MOE_ERR_IO;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  p->failed = 1;
  return moeI_seterr(p->ctx, MOE_ERR_IO, "safetensors: '%s': malformed header at byte %llu: %s", p->path,
                     (unsigned long long)(8 + p->pos), msg);
}

/* What stands at the parser's position, for messages: "'x'", "the end of the header". */
static const char *seen(const parser *p, char *buf, size_t n) {
  if (p->pos >= p->n) return "the end of the header";
  unsigned char c = (unsigned char)p->s[p->pos];
  if (c >= 0x20 && c < 0x7f) snprintf(buf, n, "'%c'", c);
  else snprintf(buf, n, "byte 0x%02x", c);
  return buf;
}

static void skip_ws(parser *p) {
  while (p->pos < p->n && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' || p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
    p->pos++;
}

static int expect(parser *p, char c, const char *where) {
  char b[32];
  skip_ws(p);
  if (p->pos < p->n && p->s[p->pos] == c) {
    p->pos++;
    return MOE_OK;
  }
  return bad(p, "expected '%c' %s, got %s", c, where, seen(p, b, sizeof b));
}

static int hex4(parser *p, unsigned *v) {
  *v = 0;
  for (int i = 0; i < 4; i++) {
    if (p->pos >= p->n) return bad(p, "unterminated \\u escape");
    char c = p->s[p->pos];
    unsigned d = c >= '0' && c <= '9' ? (unsigned)(c - '0') : c >= 'a' && c <= 'f' ? (unsigned)(c - 'a' + 10)
               : c >= 'A' && c <= 'F' ? (unsigned)(c - 'A' + 10) : 16u;
    if (d == 16) return bad(p, "a \\u escape needs four hex digits");
    *v = *v * 16 + d;
    p->pos++;
  }
  return MOE_OK;
}

/* A string at the position (after whitespace), decoded into the arena; *out points at it. */
static int string(parser *p, const char **out) {
  char b[32];
  skip_ws(p);
  if (p->pos >= p->n || p->s[p->pos] != '"') return bad(p, "expected a string, got %s", seen(p, b, sizeof b));
  p->pos++;
  char *d = p->arena + p->used;
  size_t len = 0;
  for (;;) {
    if (p->pos >= p->n) return bad(p, "unterminated string");
    unsigned char c = (unsigned char)p->s[p->pos];
    if (c == '"') break;
    if (c < 0x20) return bad(p, "control character 0x%02x in a string (JSON wants it escaped)", c);
    p->pos++;
    if (c >= 0x80) { /* a UTF-8 sequence, copied once it is well formed (RFC 3629) */
      int more = c >= 0xc2 && c <= 0xdf ? 1 : c >= 0xe0 && c <= 0xef ? 2 : c >= 0xf0 && c <= 0xf4 ? 3 : -1;
      if (more < 0) return bad(p, "byte 0x%02x begins no UTF-8 character", c);
      unsigned u = c & (0x3fu >> more);
      d[len++] = (char)c;
      for (int k = 0; k < more; k++) {
        const unsigned char t = p->pos < p->n ? (unsigned char)p->s[p->pos] : 0;
        if ((t & 0xc0) != 0x80) return bad(p, "a UTF-8 character cut short");
        u = u << 6 | (t & 0x3f);
        d[len++] = (char)t;
        p->pos++;
      }
      if ((more == 2 && u < 0x800) || (more == 3 && u < 0x10000))
        return bad(p, "an overlong UTF-8 character (U+%04X)", u);
      if ((u >= 0xd800 && u <= 0xdfff) || u > 0x10ffff) return bad(p, "U+%04X encoded in UTF-8 is no character", u);
      continue;
    }
    if (c != '\\') {
      d[len++] = (char)c;
      continue;
    }
    if (p->pos >= p->n) return bad(p, "unterminated string");
    char e = p->s[p->pos++];
    switch (e) {
    case '"': case '\\': case '/': d[len++] = e; break;
    case 'b': d[len++] = '\b'; break;
    case 'f': d[len++] = '\f'; break;
    case 'n': d[len++] = '\n'; break;
    case 'r': d[len++] = '\r'; break;
    case 't': d[len++] = '\t'; break;
    case 'u': {
      unsigned u, lo;
      int rc = hex4(p, &u);
      if (rc) return rc;
      if (u >= 0xdc00 && u <= 0xdfff) return bad(p, "a lone low surrogate \\u%04x", u);
      if (u >= 0xd800 && u <= 0xdbff) { /* a pair: the low half must follow */
        if (p->pos + 2 > p->n || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
          return bad(p, "a high surrogate \\u%04x without its low half", u);
        p->pos += 2;
        if ((rc = hex4(p, &lo)) != MOE_OK) return rc;
        if (lo < 0xdc00 || lo > 0xdfff) return bad(p, "a high surrogate followed by \\u%04x, not a low one", lo);
        u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
      }
      if (u == 0) return bad(p, "a NUL character (\\u0000) in a string");
      if (u < 0x80) d[len++] = (char)u;
      else if (u < 0x800) {
        d[len++] = (char)(0xc0 | (u >> 6));
        d[len++] = (char)(0x80 | (u & 0x3f));
      } else if (u < 0x10000) {
        d[len++] = (char)(0xe0 | (u >> 12));
        d[len++] = (char)(0x80 | ((u >> 6) & 0x3f));
        d[len++] = (char)(0x80 | (u & 0x3f));
      } else {
        d[len++] = (char)(0xf0 | (u >> 18));
        d[len++] = (char)(0x80 | ((u >> 12) & 0x3f));
        d[len++] = (char)(0x80 | ((u >> 6) & 0x3f));
        d[len++] = (char)(0x80 | (u & 0x3f));
      }
      break;
    }
    default:
      p->pos--;
      return bad(p, "unknown escape '\\%c' in a string", e);
    }
  }
  p->pos++; /* the closing quote */
  d[len] = '\0';
  p->used += len + 1;
  *out = d;
  return MOE_OK;
}

/* A non-negative integer (the shape's and the offsets'), at most 2^62 so that no sum of two
 * overflows. */
static int uint_value(parser *p, uint64_t *v, const char *what) {
  char b[32];
  skip_ws(p);
  size_t start = p->pos;
  if (p->pos >= p->n || p->s[p->pos] < '0' || p->s[p->pos] > '9')
    return bad(p, "%s must be a non-negative integer, got %s", what, seen(p, b, sizeof b));
  if (p->s[p->pos] == '0' && p->pos + 1 < p->n && p->s[p->pos + 1] >= '0' && p->s[p->pos + 1] <= '9')
    return bad(p, "%s: a number with a leading zero", what);
  uint64_t x = 0;
  while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
    const uint64_t digit = (uint64_t)(p->s[p->pos] - '0');
    if (x > ((((uint64_t)1 << 62) - digit) / 10)) { /* before x * 10 + digit could wrap */
      p->pos = start;
      return bad(p, "%s is larger than 2^62", what);
    }
    x = x * 10 + digit;
    p->pos++;
  }
  if (p->pos < p->n && (p->s[p->pos] == '.' || p->s[p->pos] == 'e' || p->s[p->pos] == 'E'))
    return bad(p, "%s must be an integer, got a fraction or an exponent", what);
  *v = x;
  return MOE_OK;
}

static int literal(parser *p, const char *word) {
  size_t n = strlen(word);
  if (p->n - p->pos < n || memcmp(p->s + p->pos, word, n) != 0) return bad(p, "expected a JSON value");
  p->pos += n;
  return MOE_OK;
}

/* A JSON number of any form, checked against the grammar and skipped. */
static int number(parser *p) {
  const char *s = p->s;
  size_t i = p->pos;
#define DIGIT(k) ((k) < p->n && s[k] >= '0' && s[k] <= '9')
  if (i < p->n && s[i] == '-') i++;
  if (!DIGIT(i)) return bad(p, "a number needs a digit");
  if (s[i] == '0') i++;
  else while (DIGIT(i)) i++;
  if (i < p->n && s[i] == '.') {
    if (!DIGIT(i + 1)) return bad(p, "a number's fraction needs a digit");
    for (i++; DIGIT(i); i++) {}
  }
  if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
    i++;
    if (i < p->n && (s[i] == '+' || s[i] == '-')) i++;
    if (!DIGIT(i)) return bad(p, "a number's exponent needs a digit");
    while (DIGIT(i)) i++;
  }
#undef DIGIT
  p->pos = i;
  return MOE_OK;
}

/* Any JSON value, checked and skipped (the metadata's: nothing of it is kept). */
static int skip_value(parser *p, int depth) {
  char b[32];
  skip_ws(p);
  if (depth > MAX_DEPTH) return bad(p, "values nested more than %d deep", MAX_DEPTH);
  if (p->pos >= p->n) return bad(p, "expected a value, got the end of the header");
  const size_t mark = p->used;
  const char *ignored;
  int rc = MOE_OK;
  switch (p->s[p->pos]) {
  case '"': rc = string(p, &ignored); break;
  case '{':
  case '[': {
    const char close = p->s[p->pos] == '{' ? '}' : ']';
    p->pos++;
    skip_ws(p);
    if (p->pos < p->n && p->s[p->pos] == close) {
      p->pos++;
      break;
    }
    for (;;) {
      if (close == '}' && ((rc = string(p, &ignored)) || (rc = expect(p, ':', "after a key")))) break;
      if ((rc = skip_value(p, depth + 1)) != MOE_OK) break;
      skip_ws(p);
      if (p->pos < p->n && p->s[p->pos] == ',') {
        p->pos++;
        continue;
      }
      rc = expect(p, close, close == '}' ? "or ',' in an object" : "or ',' in an array");
      break;
    }
    break;
  }
  case 't': rc = literal(p, "true"); break;
  case 'f': rc = literal(p, "false"); break;
  case 'n': rc = literal(p, "null"); break;
  default:
    if (p->s[p->pos] == '-' || (p->s[p->pos] >= '0' && p->s[p->pos] <= '9')) rc = number(p);
    else rc = bad(p, "expected a value, got %s", seen(p, b, sizeof b));
  }
  p->used = mark; /* nothing of it is kept */
  return rc;
}

/* [a, b, ...] of non-negative integers into v (at most max of them); *n their count. */
static int uint_array(parser *p, uint64_t *v, int max, int *n, const char *what) {
  char b[32];
  int rc = expect(p, '[', what);
  if (rc) return rc;
  *n = 0;
  skip_ws(p);
  if (p->pos < p->n && p->s[p->pos] == ']') {
    p->pos++;
    return MOE_OK;
  }
  for (;;) {
    if (*n == max) return bad(p, "%s has more than %d entries", what, max);
    if ((rc = uint_value(p, &v[(*n)++], what)) != MOE_OK) return rc;
    skip_ws(p);
    if (p->pos < p->n && p->s[p->pos] == ',') {
      p->pos++;
      continue;
    }
    if (p->pos < p->n && p->s[p->pos] == ']') {
      p->pos++;
      return MOE_OK;
    }
    return bad(p, "expected ',' or ']' in %s, got %s", what, seen(p, b, sizeof b));
  }
}

/* A tensor's object: dtype, shape and data_offsets, each once, nothing else. */
static int tensor_info(parser *p, struct entry *e) {
  int rc = expect(p, '{', "to open a tensor's entry");
  if (rc) return rc;
  int have_dtype = 0, have_shape = 0, have_offsets = 0;
  skip_ws(p);
  if (p->pos < p->n && p->s[p->pos] == '}') return bad(p, "a tensor's entry needs dtype, shape and data_offsets");
  for (;;) {
    const char *key;
    skip_ws(p);
    const size_t key_at = p->pos, mark = p->used;
    if ((rc = string(p, &key)) || (rc = expect(p, ':', "after a key"))) return rc;
    int *seen_key = strcmp(key, "dtype") == 0 ? &have_dtype : strcmp(key, "shape") == 0 ? &have_shape
                  : strcmp(key, "data_offsets") == 0 ? &have_offsets : NULL;
    if (!seen_key) {
      p->pos = key_at;
      return bad(p, "unknown key \"%s\" in a tensor's entry (dtype, shape, data_offsets)", key);
    }
    if (*seen_key) {
      p->pos = key_at;
      return bad(p, "\"%s\" given twice in a tensor's entry", key);
    }
    *seen_key = 1;
    if (seen_key == &have_dtype) {
      const char *name;
      skip_ws(p);
      const size_t at = p->pos;
      if ((rc = string(p, &name)) != MOE_OK) return rc;
      e->dtype = NULL;
      for (size_t i = 0; i < NDTYPES; i++)
        if (strcmp(name, dtypes[i].name) == 0) e->dtype = &dtypes[i];
      if (!e->dtype) {
        p->pos = at;
        return bad(p, "unknown dtype \"%s\"", name);
      }
    } else if (seen_key == &have_shape) {
      uint64_t dims[MAX_DIMS] = {0};
      if ((rc = uint_array(p, dims, MAX_DIMS, &e->ndim, "shape")) != MOE_OK) return rc;
      for (int i = 0; i < e->ndim; i++) e->shape[i] = (int64_t)dims[i];
    } else {
      uint64_t off[2];
      int n;
      skip_ws(p);
      const size_t at = p->pos;
      if ((rc = uint_array(p, off, 2, &n, "data_offsets")) != MOE_OK) return rc;
      if (n != 2) {
        p->pos = at;
        return bad(p, "data_offsets must be [begin, end], got %d numbers", n);
      }
      e->begin = off[0];
      e->end = off[1];
    }
    p->used = mark; /* the key is not kept */
    skip_ws(p);
    if (p->pos < p->n && p->s[p->pos] == ',') {
      p->pos++;
      continue;
    }
    if ((rc = expect(p, '}', "or ',' in a tensor's entry")) != MOE_OK) return rc;
    break;
  }
  if (!have_dtype || !have_shape || !have_offsets)
    return bad(p, "a tensor's entry needs dtype, shape and data_offsets (%s missing)",
               !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
  return MOE_OK;
}

static int add_entry(moe_safetensors *f, parser *p, struct entry **out) {
  if (f->count == f->cap) {
    int cap = f->cap ? f->cap * 2 : 64;
    if (cap > INT_MAX / 2) return bad(p, "too many tensors");
    struct entry *e = realloc(f->entries, (size_t)cap * sizeof *e);
    if (!e) return moeI_seterr(p->ctx, MOE_ERR_NOMEM, "safetensors: '%s': out of host memory", p->path);
    f->entries = e;
    f->cap = cap;
  }
  *out = &f->entries[f->count++];
  memset(*out, 0, sizeof **out);
  return MOE_OK;
}

static int header(moe_safetensors *f, parser *p) {
  int rc = expect(p, '{', "to open the header");
  if (rc) return rc;
  skip_ws(p);
  int metadata = 0;
  if (p->pos < p->n && p->s[p->pos] == '}') p->pos++;
  else
    for (;;) {
      const char *name;
      skip_ws(p);
      const size_t at = p->pos;
      if ((rc = string(p, &name)) || (rc = expect(p, ':', "after a tensor's name"))) return rc;
      if (strcmp(name, "__metadata__") == 0) {
        if (metadata++) {
          p->pos = at;
          return bad(p, "\"__metadata__\" given twice");
        }
        skip_ws(p);
        if (p->pos >= p->n || p->s[p->pos] != '{') return bad(p, "\"__metadata__\" must be an object");
        if ((rc = skip_value(p, 0)) != MOE_OK) return rc;
      } else {
        struct entry *e = NULL;
        if ((rc = add_entry(f, p, &e)) != MOE_OK) return rc;
        e->name = name;
        e->at = at;
        if ((rc = tensor_info(p, e)) != MOE_OK) return rc;
      }
      skip_ws(p);
      if (p->pos < p->n && p->s[p->pos] == ',') {
        p->pos++;
        continue;
      }
      if ((rc = expect(p, '}', "or ',' after a tensor")) != MOE_OK) return rc;
      break;
    }
  skip_ws(p); /* writers pad the header with spaces to align the data */
  if (p->pos != p->n) return bad(p, "text after the header's closing '}'");
  return MOE_OK;
}

/* ---- the file ---- */

static int by_name(const void *a, const void *b) {
  return strcmp(((const struct entry *)a)->name, ((const struct entry *)b)->name);
}
static int by_offsets(const void *a, const void *b) {
  const struct entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

static int io_error(moe_ctx *ctx, const char *path, const char *what) {
  return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: cannot %s '%s': %s", what, path, strerror(errno));
}

/* Reads exactly n bytes at offset; *got the bytes read when the file ends first. */
static int read_at(int fd, void *buf, size_t n, uint64_t offset, size_t *got) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    done += (size_t)r;
  }
  *got = done;
  return 0;
}

/* "[4, 3]" into buf. */
static const char *shape_text(const int64_t *shape, int ndim, char *buf, size_t n) {
  size_t len = (size_t)snprintf(buf, n, "[");
  for (int i = 0; i < ndim && len < n; i++)
    len += (size_t)snprintf(buf + len, n - len, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (len < n) snprintf(buf + len, n - len, "]");
  return buf;
}

/* Each entry's shape against its bytes and the file, the tensors tiling the data, and no name twice;
 * the entries are left in the order of their names. */
static int check_entries(moe_ctx *ctx, moe_safetensors *f) {
  char s[160];
  for (int i = 0; i < f->count; i++) {
    struct entry *e = &f->entries[i];
    uint64_t numel = 1;
    int huge = 0;
    for (int d = 0; d < e->ndim; d++) { /* each dimension is at most 2^62 */
      if (e->shape[d] == 0) numel = 0;
      else if (numel > (uint64_t)INT64_MAX / (uint64_t)e->shape[d]) huge = 1;
      else numel *= (uint64_t)e->shape[d];
    }
    if (huge && numel != 0)
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': tensor '%s' (header byte %zu): its shape %s has more "
                         "than 2^63 elements", f->path, e->name, 8 + e->at, shape_text(e->shape, e->ndim, s, sizeof s));
    e->numel = numel;
    if (e->begin > e->end)
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': tensor '%s' (header byte %zu): data_offsets [%llu, %llu] "
                         "end before they begin", f->path, e->name, 8 + e->at, (unsigned long long)e->begin,
                         (unsigned long long)e->end);
    if (e->end > f->data_size)
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': tensor '%s' (header byte %zu): data_offsets [%llu, %llu] "
                         "run past the end of the data (%llu bytes): the file is truncated or the offsets are wrong",
                         f->path, e->name, 8 + e->at, (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)f->data_size);
    if (numel > (uint64_t)INT64_MAX / (uint64_t)e->dtype->size || e->end - e->begin != numel * (uint64_t)e->dtype->size)
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': tensor '%s' (header byte %zu): data_offsets [%llu, %llu] "
                         "hold %llu bytes, but %s %s needs %llu x %d", f->path, e->name, 8 + e->at,
                         (unsigned long long)e->begin, (unsigned long long)e->end,
                         (unsigned long long)(e->end - e->begin), e->dtype->name,
                         shape_text(e->shape, e->ndim, s, sizeof s), (unsigned long long)numel, e->dtype->size);
  }
  /* The tensors tile the data, as the format wants: in the order of their offsets each begins
   * where the one before ends, from 0 to the data's end (no byte shared, none left over).  (No
   * sort of 0 or 1 entries: entries is NULL without any, which qsort may not be given.) */
  if (f->count > 1) qsort(f->entries, (size_t)f->count, sizeof *f->entries, by_offsets);
  uint64_t at = 0;
  for (int i = 0; i < f->count; i++) {
    const struct entry *e = &f->entries[i];
    if (e->begin < at)
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': tensors '%s' and '%s' share data bytes (data_offsets "
                         "[%llu, %llu] and [%llu, %llu])", f->path, f->entries[i - 1].name, e->name,
                         (unsigned long long)f->entries[i - 1].begin, (unsigned long long)at,
                         (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->begin > at)
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': data bytes [%llu, %llu] belong to no tensor (the next, "
                         "'%s', begins at %llu)", f->path, (unsigned long long)at, (unsigned long long)e->begin,
                         e->name, (unsigned long long)e->begin);
    at = e->end;
  }
  if (at != f->data_size)
    return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': data bytes [%llu, %llu] past the last tensor belong to no "
                       "tensor", f->path, (unsigned long long)at, (unsigned long long)f->data_size);
  /* then in the order of their names, which lookups search */
  if (f->count > 1) qsort(f->entries, (size_t)f->count, sizeof *f->entries, by_name);
  for (int i = 1; i < f->count; i++)
    if (strcmp(f->entries[i - 1].name, f->entries[i].name) == 0) {
      size_t a = f->entries[i - 1].at, b = f->entries[i].at;
      return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': tensor '%s' is named twice (header bytes %zu and %zu)",
                         f->path, f->entries[i].name, 8 + (a < b ? a : b), 8 + (a < b ? b : a));
    }
  return MOE_OK;
}

void moe_safetensors_close(moe_safetensors *f) {
  if (!f) return;
  if (f->fd >= 0) close(f->fd);
  free(f->entries);
  free(f->arena);
  free(f->path);
  free(f);
}

/* The header read and parsed: the steps of open after the file is open. */
static int load(moe_ctx *ctx, moe_safetensors *f) {
  const char *path = f->path;
  struct stat st;
  if (fstat(f->fd, &st) != 0) return io_error(ctx, path, "stat");
  if (!S_ISREG(st.st_mode))
    return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s' is not a regular file%s", path,
                       S_ISDIR(st.st_mode) ? " (a directory)" : "");
  const uint64_t size = (uint64_t)st.st_size;
  unsigned char len8[8];
  size_t got;
  if (size < 8)
    return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s' is %llu bytes: too short for the 8-byte header length",
                       path, (unsigned long long)size);
  if (read_at(f->fd, len8, 8, 0, &got) != 0) return io_error(ctx, path, "read");
  if (got != 8) return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': the file ended while it was read", path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
  if (n == 0) return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': the header length is 0 (no JSON header)", path);
  if (n > size - 8)
    return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': the header length %llu runs past the end of the file "
                       "(%llu bytes)", path, (unsigned long long)n, (unsigned long long)size);
  if (n > MAX_HEADER)
    return moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': the header length %llu is over the limit of %llu bytes",
                       path, (unsigned long long)n, (unsigned long long)MAX_HEADER);
  char *text = malloc((size_t)n);
  f->arena = malloc((size_t)n + 1);
  if (!text || !f->arena) {
    free(text);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "safetensors: '%s': out of host memory for a %llu-byte header", path,
                       (unsigned long long)n);
  }
  int rc = MOE_OK;
  if (read_at(f->fd, text, (size_t)n, 8, &got) != 0) rc = io_error(ctx, path, "read");
  else if (got != n) rc = moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s': the file ended while it was read", path);
  if (rc == MOE_OK) {
    parser p = {ctx, path, text, (size_t)n, 0, f->arena, 0, 0};
    f->data_start = 8 + n;
    f->data_size = size - 8 - n;
    rc = header(f, &p);
  }
  free(text);
  return rc ? rc : check_entries(ctx, f);
}

int moe_safetensors_open(moe_ctx *ctx, const char *path, moe_safetensors **out) {
  if (!out) return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: out is NULL");
  *out = NULL;
  if (!path) return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: path is NULL");
  moe_safetensors *f = calloc(1, sizeof *f);
  char *copy = malloc(strlen(path) + 1);
  if (!f || !copy) {
    free(f);
    free(copy);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "safetensors: out of host memory");
  }
  strcpy(copy, path);
  f->path = copy;
  /* O_NONBLOCK: a FIFO's open would wait for a writer; load() refuses anything not a regular file,
   * whose reads the flag does not change */
  f->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  int rc = f->fd < 0 ? io_error(ctx, path, "open") : load(ctx, f);
  if (rc) {
    moe_safetensors_close(f);
    return rc;
  }
  *out = f;
  return moeI_ok(ctx);
}

const char *moe_safetensors_path(const moe_safetensors *f) { return f ? f->path : NULL; }
int moe_safetensors_count(const moe_safetensors *f) { return f ? f->count : 0; }

int moe_safetensors_find(const moe_safetensors *f, const char *name) {
  if (!f || !name) return -1;
  int lo = 0, hi = f->count - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(f->entries[mid].name, name);
    if (c == 0) return mid;
    if (c < 0) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

int moe_safetensors_tensor(moe_ctx *ctx, const moe_safetensors *f, int i, moe_safetensors_info *out) {
  if (!f || !out) return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: tensor: %s is NULL", f ? "out" : "the file");
  if (i < 0 || i >= f->count)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: tensor %d of '%s', which holds %d tensors (0 to %d)", i, f->path,
                       f->count, f->count - 1);
  const struct entry *e = &f->entries[i];
  memset(out, 0, sizeof *out);
  out->name = e->name;
  out->dtype = e->dtype->name;
  out->ndim = e->ndim;
  for (int d = 0; d < e->ndim; d++) out->shape[d] = e->shape[d];
  out->offset = (int64_t)(f->data_start + e->begin);
  out->nbytes = (int64_t)(e->end - e->begin);
  return moeI_ok(ctx);
}

/* ---- element conversion ---- */

float moe_e4m3_to_f32(uint8_t x) { return moeI_e4m3_to_f32(x); }

static float f16_to_f32(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = ldexpf((float)m, -24);
  else v = ldexpf((float)(1024 + m), e - 25);
  return h & 0x8000 ? -v : v;
}

/* One chunk of a tensor: elements [first, first + n) from raw (the file's bytes) into out, in the
 * destination's dtype.  F8_E4M3 with a scale: element (r, c) times scale[r / 128][c / 128]. */
typedef struct conversion {
  const unsigned char *raw;
  void *out;
  int kind, to_bf16;
  int64_t first, cols;     /* cols: the tensor's last dimension (for the scale's blocks) */
  const float *scale;      /* [ceil(rows / 128), ceil(cols / 128)], or NULL */
  int64_t scale_cols;
} conversion;

static void convert(void *arg, int64_t begin, int64_t end) {
  const conversion *c = arg;
  const unsigned char *b = c->raw;
  for (int64_t i = begin; i < end; i++) {
    uint32_t u;
    float v;
    switch (c->kind) {
    case ST_BF16:
      u = (uint32_t)b[2 * i] | (uint32_t)b[2 * i + 1] << 8;
      if (c->to_bf16) { /* bit for bit: NaN payloads included */
        ((uint16_t *)c->out)[i] = (uint16_t)u;
        continue;
      }
      v = bf16_to_f32((uint16_t)u);
      break;
    case ST_F16: v = f16_to_f32((uint16_t)(b[2 * i] | b[2 * i + 1] << 8)); break;
    case ST_F32:
      u = (uint32_t)b[4 * i] | (uint32_t)b[4 * i + 1] << 8 | (uint32_t)b[4 * i + 2] << 16 |
          (uint32_t)b[4 * i + 3] << 24;
      if (!c->to_bf16) {
        ((uint32_t *)c->out)[i] = u;
        continue;
      }
      memcpy(&v, &u, sizeof v);
      break;
    default:
      v = moe_e4m3_to_f32(b[i]);
      if (c->scale) {
        const int64_t at = c->first + i, r = at / c->cols, col = at % c->cols;
        v = v * c->scale[(r / BLOCK) * c->scale_cols + col / BLOCK];
      }
    }
    if (c->to_bf16) ((uint16_t *)c->out)[i] = f32_to_bf16(v);
    else ((float *)c->out)[i] = v;
  }
}

/* "BF16 [4, 3]" of an entry. */
static const char *entry_text(const struct entry *e, char *buf, size_t n) {
  char s[160];
  snprintf(buf, n, "%s %s", e->dtype->name, shape_text(e->shape, e->ndim, s, sizeof s));
  return buf;
}

static int check_read(moe_ctx *ctx, const moe_safetensors *f, const struct entry *e, const moe_tensor *scale,
                      const moe_tensor *dst) {
  char a[200], b[160];
  if (e->dtype->kind == ST_OTHER)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s': tensor '%s' is %s; only " READABLE " can be read",
                       f->path, e->name, entry_text(e, a, sizeof a));
  if (dst->dtype == MOE_E4M3 && e->dtype->kind != ST_E4M3)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s': tensor '%s' is %s, which reads into bf16 or f32; "
                       "only F8_E4M3 reads into e4m3, got %s", f->path, e->name, entry_text(e, a, sizeof a),
                       moeI_tensor_describe(dst, b, sizeof b));
  if (dst->dtype != MOE_BF16 && dst->dtype != MOE_F32 && dst->dtype != MOE_E4M3)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s': tensor '%s' is read into bf16 or f32 (F8_E4M3 also into "
                       "e4m3), not into %s", f->path, e->name, moeI_tensor_describe(dst, b, sizeof b));
  int same = dst->ndim == e->ndim;
  for (int d = 0; same && d < e->ndim; d++) same = dst->shape[d] == e->shape[d];
  if (!same)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s': tensor '%s' is %s, the destination is %s", f->path,
                       e->name, entry_text(e, a, sizeof a), moeI_tensor_describe(dst, b, sizeof b));
  if (!scale) return MOE_OK;
  if (dst->dtype == MOE_E4M3)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s': tensor '%s' is read into e4m3 as it is, without a scale; "
                       "read its scale into a tensor of its own", f->path, e->name);
  if (e->dtype->kind != ST_E4M3 || e->ndim != 2)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s': a block scale goes with a 2-D F8_E4M3 tensor; '%s' is %s",
                       f->path, e->name, entry_text(e, a, sizeof a));
  const int64_t want[2] = {(e->shape[0] + BLOCK - 1) / BLOCK, (e->shape[1] + BLOCK - 1) / BLOCK};
  if (!moeI_on_cpu(scale))
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: the scale of '%s' must be on the CPU, got %s", e->name,
                       moeI_tensor_describe(scale, b, sizeof b));
  if (scale->dtype != MOE_F32 || scale->ndim != 2 || scale->shape[0] != want[0] || scale->shape[1] != want[1])
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: the scale of '%s' (%s, in %dx%d blocks) must be f32 [%lld, "
                       "%lld], got %s", e->name, entry_text(e, a, sizeof a), BLOCK, BLOCK, (long long)want[0],
                       (long long)want[1], moeI_tensor_describe(scale, b, sizeof b));
  return MOE_OK;
}

int moe_safetensors_read(moe_ctx *ctx, moe_safetensors *f, const char *name, const moe_tensor *scale,
                         moe_tensor *dst) {
  if (!f || !name || !dst)
    return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: read: %s is NULL", !f ? "the file" : !name ? "name" : "dst");
  const int i = moe_safetensors_find(f, name);
  if (i < 0) return moeI_seterr(ctx, MOE_ERR_ARG, "safetensors: '%s' has no tensor '%s'", f->path, name);
  const struct entry *e = &f->entries[i];
  int rc = check_read(ctx, f, e, scale, dst);
  if (rc) return rc;
  const int64_t total = (int64_t)e->numel, src_size = e->dtype->size;
  const size_t dst_size = moe_dtype_size(dst->dtype);
  const int64_t chunk = total < CHUNK ? total : CHUNK;
  unsigned char *raw = malloc((size_t)(chunk * src_size) + 1);
  unsigned char *staged = moeI_on_cpu(dst) ? NULL : malloc((size_t)chunk * dst_size + 1);
  if (!raw || (!moeI_on_cpu(dst) && !staged)) {
    free(raw);
    free(staged);
    return moeI_seterr(ctx, MOE_ERR_NOMEM, "safetensors: out of host memory reading '%s'", name);
  }
  conversion c = {raw, NULL, e->dtype->kind, dst->dtype == MOE_BF16, 0, e->ndim ? e->shape[e->ndim - 1] : 1,
                  scale ? (const float *)scale->data : NULL, scale ? scale->shape[1] : 0};
  const moe_device cpu = {MOE_CPU, 0};
  for (int64_t first = 0; first < total && rc == MOE_OK; first += chunk) {
    const int64_t n = total - first < chunk ? total - first : chunk;
    const uint64_t at = f->data_start + e->begin + (uint64_t)(first * src_size);
    size_t got;
    if (read_at(f->fd, raw, (size_t)(n * src_size), at, &got) != 0) {
      rc = moeI_seterr(ctx, MOE_ERR_IO, "safetensors: cannot read tensor '%s' of '%s': %s", name, f->path,
                       strerror(errno));
      break;
    }
    if (got != (size_t)(n * src_size)) {
      rc = moeI_seterr(ctx, MOE_ERR_IO, "safetensors: '%s' ends at byte %llu, inside tensor '%s' (bytes %llu to %llu): "
                       "the file was truncated after it was opened", f->path, (unsigned long long)(at + got), name,
                       (unsigned long long)(f->data_start + e->begin), (unsigned long long)(f->data_start + e->end));
      break;
    }
    c.first = first;
    char *out = staged ? (char *)staged : (char *)dst->data + (size_t)first * dst_size;
    c.out = out;
    if (dst->dtype == MOE_E4M3) memcpy(out, raw, (size_t)n); /* the file's bytes are the tensor's */
    else moeI_parallel_for(n, (int64_t)1 << 18, convert, &c);
    if (staged)
      rc = moeI_cuda_memcpy(ctx, dst->device, (char *)dst->data + (size_t)first * dst_size, cpu, staged,
                            (size_t)n * dst_size);
  }
  free(raw);
  free(staged);
  return rc ? rc : moeI_ok(ctx);
}
