/* SPDX-License-Identifier: MIT */
/* test_safetensors.c -- the safetensors reader (lib/safetensors.c) through the public API: the
 * E4M3 decode of every code, each source dtype read into bf16 and f32 against values worked out
 * here, FP8 block scales with partial blocks, and every malformed file and misuse it must refuse,
 * with the words of its message.  Files are written into a fresh directory under /tmp and removed.
 * Exits non-zero when a check fails. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, ftruncate */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "moelab.h"

static moe_ctx *ctx;
static char dir[64];
static char paths[64][128];
static int npaths;

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NDIM(...) ((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

/* The call failed with code and a message holding frag. */
static void expect_error(int rc, int code, const char *frag, int line) {
  const char *msg = moe_errmsg(ctx);
  checks++;
  if (rc != code || !strstr(msg, frag)) {
    failures++;
    fprintf(stderr, "%s:%d: want %d and \"...%s...\", got %d and \"%s\"\n", __FILE__, line, code, frag, rc, msg);
  }
}
#define EXPECT_ERROR(rc, code, frag) expect_error((rc), (code), (frag), __LINE__)

/* A file of the directory: the 8-byte length of header, header, then n bytes of data. */
static const char *write_file(const char *name, const char *header, const void *data, size_t n) {
  if (npaths == 64) exit(2);
  char *path = paths[npaths++];
  snprintf(path, sizeof paths[0], "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) {
    perror(path);
    exit(2);
  }
  uint64_t len = strlen(header);
  for (int i = 0; i < 8; i++) fputc((int)(len >> (8 * i) & 0xff), f);
  fwrite(header, 1, len, f);
  if (n) fwrite(data, 1, n, f);
  fclose(f);
  return path;
}

static moe_tensor *cpu(moe_dtype dt, int ndim, const int64_t *shape) {
  moe_tensor *t;
  if (moe_tensor_new(ctx, dt, ndim, shape, (moe_device){MOE_CPU, 0}, &t) != MOE_OK) {
    fprintf(stderr, "tensor_new: %s\n", moe_errmsg(ctx));
    exit(2);
  }
  return t;
}

/* OCP E4M3 by its definition, in double: (-1)^s (1 + m/8) 2^(e-7), subnormals m/8 2^-6. */
static double e4m3_reference(unsigned q) {
  const unsigned s = q >> 7, e = (q >> 3) & 15, m = q & 7;
  double v = e == 0 ? m / 8.0 * pow(2, -6) : (1 + m / 8.0) * pow(2, (double)e - 7);
  return s ? -v : v;
}

static void test_e4m3(void) {
  int nans = 0;
  for (unsigned q = 0; q < 256; q++) {
    float got = moe_e4m3_to_f32((uint8_t)q);
    if ((q & 0x7f) == 0x7f) {
      nans++;
      CHECK(isnan(got), "e4m3 0x%02x = %g, want NaN", q, (double)got);
      continue;
    }
    CHECK(got == e4m3_reference(q) && !!signbit(got) == (q >= 128), "e4m3 0x%02x = %g, want %g", q, (double)got,
          e4m3_reference(q));
  }
  CHECK(nans == 2, "%d NaN codes", nans);
  CHECK(moe_e4m3_to_f32(0x7e) == 448.0f && moe_e4m3_to_f32(0xfe) == -448.0f, "max 448");
  CHECK(moe_e4m3_to_f32(0x01) == 0x1p-9f, "the smallest subnormal");
  CHECK(moe_e4m3_to_f32(0x08) == 0x1p-6f, "the smallest normal");
  CHECK(moe_e4m3_to_f32(0x78) == 256.0f, "no infinity: 0x78 is 256");
}

/* Malformed files: each opens with MOE_ERR_IO and a message holding its fragment. */
static void test_malformed(void) {
  static const struct {
    const char *header, *frag;
  } rows[] = {
    {"", "header length is 0"},
    {"[]", "byte 8: expected '{' to open the header, got '['"},
    {"{", "byte 9: expected a string, got the end of the header"},
    {"{\"a\" {}}", "byte 13: expected ':' after a tensor's name, got '{'"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},}", "expected a string, got '}'"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x", "text after the header's closing '}'"},
    {"{\"a", "unterminated string"},
    {"{\"a\tb\":{}}", "control character 0x09 in a string"},
    {"{\"a\\q\":{}}", "unknown escape '\\q'"},
    {"{\"a\\u12\":{}}", "four hex digits"},
    {"{\"a\\u0000\":{}}", "a NUL character"},
    {"{\"a\\udc00\":{}}", "a lone low surrogate"},
    {"{\"a\\ud800x\":{}}", "without its low half"},
    {"{\"a\":{}}", "needs dtype, shape and data_offsets"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", "(data_offsets missing)"},
    {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\"}}", "\"dtype\" given twice"},
    {"{\"a\":{\"dtype\":\"F32\",\"kind\":1}}", "unknown key \"kind\""},
    {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,4]}}", "unknown dtype \"Q4\""},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}",
     "shape must be a non-negative integer, got '-'"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", "shape must be an integer"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}", "leading zero"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[99999999999999999999],\"data_offsets\":[0,4]}}", "larger than 2^62"},
    /* 2^64 + 1: would wrap to 1 if the bound were checked after the multiplication */
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[18446744073709551617],\"data_offsets\":[0,4]}}", "larger than 2^62"},
    {"{\"a\xff\":{}}", "byte 0xff begins no UTF-8 character"},
    {"{\"a\xc3\":{}}", "a UTF-8 character cut short"},
    {"{\"a\xe0\x80\xaf\":{}}", "an overlong UTF-8 character (U+002F)"},
    {"{\"a\xed\xa0\x80\":{}}", "U+D800 encoded in UTF-8 is no character"},
    {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
     "\"b\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[2,4]}}", "tensors 'a' and 'b' share data bytes"},
    {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[2,4]}}",
     "data bytes [0, 2] belong to no tensor (the next, 'a', begins at 2)"},
    {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]}}",
     "data bytes [2, 4] past the last tensor belong to no tensor"},
    {"{}", "data bytes [0, 4] past the last tensor"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,2,3,4,5,6,7,8,9],\"data_offsets\":[0,4]}}", "more than 8 entries"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", "must be [begin, end], got 1 numbers"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4}}", "expected ',' or ']' in data_offsets"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}", "run past the end of the data (4 bytes)"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", "end before they begin"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", "hold 4 bytes, but F32 [2] needs 2 x 4"},
    {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", "more than 2^63"},
    {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[0,2]},"
     "\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[2,4]}}", "tensor 'a' is named twice"},
    {"{\"__metadata__\":[]}", "\"__metadata__\" must be an object"},
    {"{\"__metadata__\":{},\"__metadata__\":{}}", "\"__metadata__\" given twice"},
    {"{\"__metadata__\":{\"a\":[1,2,]}}", "expected a value, got ']'"},
    {"{\"__metadata__\":{\"a\":tru}}", "expected a JSON value"},
    {"{\"__metadata__\":{\"a\":-}}", "a number needs a digit"},
    {"{\"__metadata__\":{\"a\":1.}}", "fraction needs a digit"},
    {"{\"__metadata__\":{\"a\":1e+}}", "exponent needs a digit"},
  };
  const float four = 0;
  /* nesting past the parser's limit (it recurses once a level) */
  char deep[256] = "{\"__metadata__\":{\"a\":";
  for (int i = 0; i < 70; i++) strcat(deep, "[");
  for (int i = 0; i < 70; i++) strcat(deep, "]");
  strcat(deep, "}}");
  moe_safetensors *g = NULL;
  EXPECT_ERROR(moe_safetensors_open(ctx, write_file("deep.safetensors", deep, &four, sizeof four), &g), MOE_ERR_IO,
               "nested more than 64 deep");
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "bad%zu.safetensors", i);
    const char *path = write_file(name, rows[i].header, &four, sizeof four);
    moe_safetensors *f = (moe_safetensors *)&four; /* must come back NULL */
    int rc = moe_safetensors_open(ctx, path, &f);
    EXPECT_ERROR(rc, MOE_ERR_IO, rows[i].frag);
    CHECK(f == NULL, "row %zu: a failed open leaves out NULL", i);
    CHECK(rc != MOE_OK || strstr(moe_errmsg(ctx), path), "row %zu: the message names the file", i);
    moe_safetensors_close(f);
  }
  /* the file itself */
  moe_safetensors *f = NULL;
  char missing[160];
  snprintf(missing, sizeof missing, "%s/absent.safetensors", dir);
  EXPECT_ERROR(moe_safetensors_open(ctx, missing, &f), MOE_ERR_IO, "cannot open");
  CHECK(strstr(moe_errmsg(ctx), "absent.safetensors") && strstr(moe_errmsg(ctx), "No such file"), "%s",
        moe_errmsg(ctx));
  EXPECT_ERROR(moe_safetensors_open(ctx, dir, &f), MOE_ERR_IO, "is not a regular file (a directory)");
  char fifo[160]; /* refused at once, not waited on for a writer */
  snprintf(fifo, sizeof fifo, "%s/fifo.safetensors", dir);
  CHECK(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
  EXPECT_ERROR(moe_safetensors_open(ctx, fifo, &f), MOE_ERR_IO, "is not a regular file");
  unlink(fifo);
  /* no tensors and no data: a file the format's writers make */
  CHECK(moe_safetensors_open(ctx, write_file("empty.safetensors", "{}", NULL, 0), &f) == MOE_OK &&
            moe_safetensors_count(f) == 0, "an empty file opens: %s", moe_errmsg(ctx));
  moe_safetensors_close(f);
  f = NULL;
  const char *tiny = write_file("tiny.safetensors", "", NULL, 0);
  FILE *t = fopen(tiny, "wb");
  fputs("abc", t);
  fclose(t);
  EXPECT_ERROR(moe_safetensors_open(ctx, tiny, &f), MOE_ERR_IO, "3 bytes: too short for the 8-byte header length");
  const char *past = write_file("past.safetensors", "{}", NULL, 0);
  t = fopen(past, "r+b");
  fputc(200, t); /* a header length of 200 in a file of 10 bytes */
  fclose(t);
  EXPECT_ERROR(moe_safetensors_open(ctx, past, &f), MOE_ERR_IO, "header length 200 runs past the end of the file (10");
  EXPECT_ERROR(moe_safetensors_open(ctx, NULL, &f), MOE_ERR_ARG, "path is NULL");
  EXPECT_ERROR(moe_safetensors_open(ctx, past, NULL), MOE_ERR_ARG, "out is NULL");
}

/* Dtypes listed but not read (here the MX formats' F8_E8M0 scales and C64) do not keep the rest
 * of the file from opening; reading one says what can be read. */
static void test_listed(void) {
  const unsigned char data[4 + 8 + 4] = {0};
  const char *path = write_file("listed.safetensors",
                                "{\"m\":{\"dtype\":\"F8_E8M0\",\"shape\":[4],\"data_offsets\":[0,4]},"
                                "\"z\":{\"dtype\":\"C64\",\"shape\":[1],\"data_offsets\":[4,12]},"
                                "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}",
                                data, sizeof data);
  moe_safetensors *f = NULL;
  if (moe_safetensors_open(ctx, path, &f) != MOE_OK) {
    CHECK(0, "open: %s", moe_errmsg(ctx));
    return;
  }
  moe_safetensors_info in;
  CHECK(moe_safetensors_tensor(ctx, f, 0, &in) == MOE_OK && strcmp(in.dtype, "F8_E8M0") == 0 && in.nbytes == 4,
        "F8_E8M0 listed");
  moe_tensor *x = cpu(MOE_F32, 1, SHAPE(1)), *m = cpu(MOE_F32, 1, SHAPE(4));
  CHECK(moe_safetensors_read(ctx, f, "x", NULL, x) == MOE_OK, "the F32 beside it reads: %s", moe_errmsg(ctx));
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "m", NULL, m), MOE_ERR_ARG,
               "tensor 'm' is F8_E8M0 [4]; only BF16, F16, F32 and F8_E4M3 can be read");
  moe_tensor_free(x);
  moe_tensor_free(m);
  moe_safetensors_close(f);
}

/* A file with one tensor of every readable dtype, and their reads. */
static void test_reads(void) {
  /* a: BF16 [2, 3] with -0, a signalling NaN's payload and the largest finite value */
  const uint16_t a[6] = {0x3f80, 0x8000, 0x7f81, 0x7f7f, 0x0001, 0xc2f7};
  /* b: F32 [4] with a NaN payload, a value that rounds to even in bf16, and one that rounds up */
  const uint32_t b[4] = {0x7fa00001u, 0x3f808000u, 0x3f818000u, 0xbf800001u};
  /* c: F16 [7] */
  const uint16_t c[7] = {0x3c00, 0xc000, 0x0001, 0x7c00, 0x7e00, 0x03ff, 0x7bff};
  const double c_want[7] = {1, -2, 0x1p-24, INFINITY, NAN, 1023 * 0x1p-24, 65504};
  /* d: F8_E4M3 [130, 129] and its scale [2, 2]: four blocks, three of them partial */
  enum { R = 130, C = 129 };
  static uint8_t d[R * C];
  const float scale[4] = {0.5f, 0x1.8p-7f, 3.0f, 0.0f};
  for (int i = 0; i < R * C; i++) d[i] = (uint8_t)((i * 37 + 11) % 256);
  const int64_t scalar_v = 0; /* e: F32 [] (a scalar, 1 element), f: BF16 [0, 4] (no bytes), g: I64 [1] */
  const float e = 2.5f;
  static unsigned char data[12 + 16 + 14 + R * C + 4 + 8 + 4 * 4];
  size_t at = 0;
#define PUT(p, n) (memcpy(data + at, (p), (n)), at += (n))
  PUT(a, sizeof a);
  PUT(b, sizeof b);
  PUT(c, sizeof c);
  PUT(d, sizeof d);
  PUT(&e, sizeof e);
  PUT(&scalar_v, sizeof scalar_v);
  PUT(scale, sizeof scale);
#undef PUT
  char header[1024];
  snprintf(header, sizeof header,
           "{\"__metadata__\":{\"format\":\"pt\",\"n\":[1,-2.5e3,true,false,null,{\"x\":\"\\u00e9\"}]},"
           "\"a\":{\"dtype\":\"BF16\",\"shape\":[2,3],\"data_offsets\":[0,12]},\n"
           " \"b\" : { \"shape\" : [4], \"dtype\" : \"F32\", \"data_offsets\" : [12,28] },"
           "\"c\\u00e9\\ud83d\\ude00\":{\"dtype\":\"F16\",\"shape\":[7],\"data_offsets\":[28,42]},"
           "\"d\":{\"dtype\":\"F8_E4M3\",\"shape\":[%d,%d],\"data_offsets\":[42,%d]},"
           "\"e\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[%d,%d]},"
           "\"f\":{\"dtype\":\"BF16\",\"shape\":[0,4],\"data_offsets\":[%d,%d]},"
           "\"g\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[%d,%d]},"
           "\"s\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[%d,%d]}}     ",
           R, C, 42 + R * C, 42 + R * C, 46 + R * C, 46 + R * C, 46 + R * C, 46 + R * C, 54 + R * C, 54 + R * C,
           70 + R * C);
  const char *path = write_file("all.safetensors", header, data, at);
  moe_safetensors *f = NULL;
  if (moe_safetensors_open(ctx, path, &f) != MOE_OK) {
    CHECK(0, "open: %s", moe_errmsg(ctx));
    return;
  }
  CHECK(strcmp(moe_safetensors_path(f), path) == 0, "path");
  /* the names in order, the metadata not among them */
  CHECK(moe_safetensors_count(f) == 8, "count %d", moe_safetensors_count(f));
  const char *order[8] = {"a", "b", "c\xc3\xa9\xf0\x9f\x98\x80", "d", "e", "f", "g", "s"};
  for (int i = 0; i < 8; i++) {
    moe_safetensors_info in;
    CHECK(moe_safetensors_tensor(ctx, f, i, &in) == MOE_OK && strcmp(in.name, order[i]) == 0, "name %d", i);
    CHECK(moe_safetensors_find(f, order[i]) == i, "find %d", i);
  }
  CHECK(moe_safetensors_find(f, "__metadata__") == -1 && moe_safetensors_find(f, "z") == -1, "absent names");
  moe_safetensors_info in;
  CHECK(moe_safetensors_tensor(ctx, f, 3, &in) == MOE_OK && strcmp(in.dtype, "F8_E4M3") == 0 && in.ndim == 2 &&
            in.shape[0] == R && in.shape[1] == C && in.nbytes == R * C &&
            in.offset == (int64_t)(8 + strlen(header) + 42),
        "d's entry: %s [%lld, %lld] at %lld", in.dtype, (long long)in.shape[0], (long long)in.shape[1],
        (long long)in.offset);
  EXPECT_ERROR(moe_safetensors_tensor(ctx, f, 8, &in), MOE_ERR_ARG, "tensor 8 of");
  EXPECT_ERROR(moe_safetensors_tensor(ctx, f, -1, &in), MOE_ERR_ARG, "holds 8 tensors (0 to 7)");

  /* BF16 -> bf16 bit for bit; -> f32 exactly */
  moe_tensor *ab = cpu(MOE_BF16, 2, SHAPE(2, 3)), *af = cpu(MOE_F32, 2, SHAPE(2, 3));
  CHECK(moe_safetensors_read(ctx, f, "a", NULL, ab) == MOE_OK, "%s", moe_errmsg(ctx));
  CHECK(memcmp(moe_tensor_data(ab), a, sizeof a) == 0, "BF16 into bf16 is bit for bit");
  CHECK(moe_safetensors_read(ctx, f, "a", NULL, af) == MOE_OK, "%s", moe_errmsg(ctx));
  for (int i = 0; i < 6; i++) {
    uint32_t u;
    memcpy(&u, (float *)moe_tensor_data(af) + i, 4);
    CHECK(u == (uint32_t)a[i] << 16, "BF16 %04x into f32: %08x", a[i], u);
  }
  /* F32 -> f32 bit for bit; -> bf16 to nearest even */
  moe_tensor *bf = cpu(MOE_F32, 1, SHAPE(4)), *bb = cpu(MOE_BF16, 1, SHAPE(4));
  CHECK(moe_safetensors_read(ctx, f, "b", NULL, bf) == MOE_OK, "%s", moe_errmsg(ctx));
  CHECK(memcmp(moe_tensor_data(bf), b, sizeof b) == 0, "F32 into f32 is bit for bit");
  CHECK(moe_safetensors_read(ctx, f, "b", NULL, bb) == MOE_OK, "%s", moe_errmsg(ctx));
  const uint16_t *bbits = moe_tensor_data(bb);
  CHECK((bbits[0] & 0x7f80) == 0x7f80 && (bbits[0] & 0x7f), "a NaN stays NaN: %04x", bbits[0]);
  CHECK(bbits[1] == 0x3f80 && bbits[2] == 0x3f82 && bbits[3] == 0xbf80, "F32 into bf16: %04x %04x %04x", bbits[1],
        bbits[2], bbits[3]);
  /* F16 -> f32 */
  moe_tensor *cf = cpu(MOE_F32, 1, SHAPE(7));
  CHECK(moe_safetensors_read(ctx, f, order[2], NULL, cf) == MOE_OK, "%s", moe_errmsg(ctx));
  for (int i = 0; i < 7; i++) {
    float v = ((float *)moe_tensor_data(cf))[i];
    CHECK(isnan(c_want[i]) ? isnan(v) : v == c_want[i], "F16 %04x = %g, want %g", c[i], (double)v, c_want[i]);
  }
  /* F8_E4M3 with its block scale -> bf16 = bf16(f32(e4m3(q) x scale of its block)); without -> e4m3(q) */
  moe_tensor *s = cpu(MOE_F32, 2, SHAPE(2, 2)), *db = cpu(MOE_BF16, 2, SHAPE(R, C)), *df = cpu(MOE_F32, 2, SHAPE(R, C));
  CHECK(moe_safetensors_read(ctx, f, "s", NULL, s) == MOE_OK, "%s", moe_errmsg(ctx));
  CHECK(moe_safetensors_read(ctx, f, "d", s, db) == MOE_OK, "%s", moe_errmsg(ctx));
  CHECK(moe_safetensors_read(ctx, f, "d", NULL, df) == MOE_OK, "%s", moe_errmsg(ctx));
  int bad_scaled = 0, bad_raw = 0;
  for (int r = 0; r < R; r++)
    for (int col = 0; col < C; col++) {
      const int i = r * C + col;
      const float q = (float)e4m3_reference(d[i]), sc = scale[(r / 128) * 2 + col / 128];
      const uint16_t want = (d[i] & 0x7f) == 0x7f ? 0 : moe_f32_to_bf16(q * sc);
      const uint16_t got = ((const uint16_t *)moe_tensor_data(db))[i];
      const float raw = ((const float *)moe_tensor_data(df))[i];
      if ((d[i] & 0x7f) == 0x7f ? !((got & 0x7f80) == 0x7f80 && (got & 0x7f)) : got != want) bad_scaled++;
      if ((d[i] & 0x7f) == 0x7f ? !isnan(raw) : raw != q) bad_raw++;
      if (bad_scaled == 1 && got != want) {
        CHECK(0, "F8 (%d, %d) = %04x, want %04x", r, col, got, want);
        bad_scaled++;
      }
    }
  CHECK(bad_scaled == 0, "%d scaled F8 values wrong", bad_scaled);
  CHECK(bad_raw == 0, "%d unscaled F8 values wrong", bad_raw);
  /* a scalar and an empty tensor */
  moe_tensor *ef = cpu(MOE_F32, 0, NULL), *fb = cpu(MOE_BF16, 2, SHAPE(0, 4));
  CHECK(moe_safetensors_read(ctx, f, "e", NULL, ef) == MOE_OK && *(float *)moe_tensor_data(ef) == 2.5f, "scalar: %s",
        moe_errmsg(ctx));
  CHECK(moe_safetensors_read(ctx, f, "f", NULL, fb) == MOE_OK, "empty: %s", moe_errmsg(ctx));

  /* misuse: each refused with MOE_ERR_ARG, nothing written */
  moe_tensor *wrong = cpu(MOE_BF16, 2, SHAPE(3, 2)), *i32 = cpu(MOE_I32, 2, SHAPE(2, 3));
  moe_tensor *s_bad = cpu(MOE_F32, 2, SHAPE(1, 2)), *s_bf = cpu(MOE_BF16, 2, SHAPE(2, 2));
  moe_tensor *g = cpu(MOE_F32, 1, SHAPE(1));
  moe_tensor *cb = cpu(MOE_BF16, 1, SHAPE(7));
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "zz", NULL, ab), MOE_ERR_ARG, "has no tensor 'zz'");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "a", NULL, wrong), MOE_ERR_ARG,
               "tensor 'a' is BF16 [2, 3], the destination is bf16 [3, 2] on cpu");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "a", NULL, i32), MOE_ERR_ARG, "read into bf16 or f32 (F8_E4M3 also into e4m3), not into i32 [2, 3]");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "g", NULL, g), MOE_ERR_ARG,
               "tensor 'g' is I64 [1]; only BF16, F16, F32 and F8_E4M3 can be read");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "c\xc3\xa9\xf0\x9f\x98\x80", s, cb), MOE_ERR_ARG,
               "a block scale goes with a 2-D F8_E4M3 tensor");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "d", s_bad, db), MOE_ERR_ARG, "must be f32 [2, 2], got f32 [1, 2] on cpu");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "d", s_bf, db), MOE_ERR_ARG, "must be f32 [2, 2], got bf16 [2, 2]");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, NULL, NULL, db), MOE_ERR_ARG, "name is NULL");
  EXPECT_ERROR(moe_safetensors_read(ctx, NULL, "a", NULL, db), MOE_ERR_ARG, "the file is NULL");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "a", NULL, NULL), MOE_ERR_ARG, "dst is NULL");
  CHECK(memcmp(moe_tensor_data(ab), a, sizeof a) == 0, "a refused read leaves the destination");

  /* the file cut short after it was opened: the read says so */
  if (truncate(path, (off_t)(8 + strlen(header) + 50)) != 0) perror("truncate");
  EXPECT_ERROR(moe_safetensors_read(ctx, f, "d", s, db), MOE_ERR_IO, "the file was truncated after it was opened");
  CHECK(strstr(moe_errmsg(ctx), "inside tensor 'd'") != NULL, "%s", moe_errmsg(ctx));

  moe_tensor *all[] = {ab, af, bf, bb, cf, s, db, df, ef, fb, wrong, i32, s_bad, s_bf, g, cb};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) moe_tensor_free(all[i]);
  moe_safetensors_close(f);
  moe_safetensors_close(NULL);
}

int main(void) {
  if (moe_ctx_open(&ctx) != MOE_OK) return 2;
  snprintf(dir, sizeof dir, "/tmp/moelab-st.XXXXXX");
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 2;
  }
  test_e4m3();
  test_malformed();
  test_reads();
  test_listed();
  for (int i = 0; i < npaths; i++) unlink(paths[i]);
  rmdir(dir);
  moe_ctx_close(ctx);
  printf("test_safetensors: %d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}
