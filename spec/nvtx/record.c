/* SPDX-License-Identifier: MIT */
/* record.c -- an NVTX tool for the tests: loaded by the NVTX 3 headers of the program under test
 * when NVTX_INJECTION64_PATH names this library, it writes every range pushed and popped to the
 * file MOE_NVTX_RECORD names, a line each:
 *
 *   push <TAB> domain <TAB> name      (the domain "" for NVTX's default domain)
 *   pop <TAB> domain
 *
 * in the order of the calls, so that spec/nvtx_spec.lua can rebuild the tree of ranges.  It fills
 * only the table entries of the calls that push, pop and make domains; NVTX turns every other
 * call into a no-op. */
#define _POSIX_C_SOURCE 200809L
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* NVTX leaves a domain's handle to the tool: here, its name. */
struct nvtxDomainRegistration_st {
  char name[128];
};

static FILE *out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int depth;

static void record(const char *what, nvtxDomainHandle_t domain, const char *name) {
  pthread_mutex_lock(&lock);
  if (name) fprintf(out, "%s\t%s\t%s\n", what, domain ? domain->name : "", name);
  else fprintf(out, "%s\t%s\n", what, domain ? domain->name : "");
  fflush(out);
  pthread_mutex_unlock(&lock);
}

static const char *message_of(const nvtxEventAttributes_t *a) {
  if (!a) return "(no attributes)";
  if (a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii) return a->message.ascii;
  return "(not ASCII)";
}

/* The domains made so far, one per name: the tool owns them for the life of the process (a program
 * may drop its handle, a module unloaded at exit takes its copy with it). */
enum { MAX_DOMAINS = 64 };
static struct nvtxDomainRegistration_st domains[MAX_DOMAINS];
static int ndomains;

static nvtxDomainHandle_t domain_create(const char *name) {
  nvtxDomainHandle_t d = NULL;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < ndomains && !d; i++)
    if (strncmp(domains[i].name, name ? name : "", sizeof domains[i].name) == 0) d = &domains[i];
  if (!d && ndomains < MAX_DOMAINS) {
    d = &domains[ndomains++];
    snprintf(d->name, sizeof d->name, "%s", name ? name : "");
  }
  pthread_mutex_unlock(&lock);
  return d;
}

static void domain_destroy(nvtxDomainHandle_t d) { (void)d; }

static int domain_push(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
  record("push", d, message_of(a));
  return depth++;
}

static int domain_pop(nvtxDomainHandle_t d) {
  record("pop", d, NULL);
  return depth > 0 ? --depth : -1;
}

static int push_ex(const nvtxEventAttributes_t *a) { return domain_push(NULL, a); }

static int push_a(const char *message) {
  record("push", NULL, message ? message : "");
  return depth++;
}

static int pop(void) { return domain_pop(NULL); }

/* Points entry id of a module's table at fn. */
static int set_entry(const NvtxExportTableCallbacks *cb, NvtxCallbackModule module, unsigned id,
                     NvtxFunctionPointer fn) {
  NvtxFunctionTable table = NULL;
  unsigned size = 0;
  if (!cb->GetModuleFunctionTable(module, &table, &size) || !table || id >= size || !table[id]) return 0;
  *table[id] = fn;
  return 1;
}

/* The entry point the NVTX headers look up in the library NVTX_INJECTION64_PATH names; 0 refuses. */
__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const char *path = getenv("MOE_NVTX_RECORD");
  const NvtxExportTableCallbacks *cb = get_table(NVTX_ETID_CALLBACKS);
  if (!path || !cb || cb->struct_size < sizeof *cb) return 0;
  pthread_mutex_lock(&lock);
  if (!out) out = fopen(path, "w");
  pthread_mutex_unlock(&lock);
  if (!out) return 0;
  return set_entry(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainCreateA, (NvtxFunctionPointer)domain_create) &&
         set_entry(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainDestroy, (NvtxFunctionPointer)domain_destroy) &&
         set_entry(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePushEx, (NvtxFunctionPointer)domain_push) &&
         set_entry(cb, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePop, (NvtxFunctionPointer)domain_pop) &&
         set_entry(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushEx, (NvtxFunctionPointer)push_ex) &&
         set_entry(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushA, (NvtxFunctionPointer)push_a) &&
         set_entry(cb, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePop, (NvtxFunctionPointer)pop);
}
