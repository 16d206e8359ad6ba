/* An NVTX v3 injection library that records every NVTX call a process makes, for the tests.
 *
 * Loaded by the NVTX headers compiled into the program (here: the `nvtx` Python package) when
 * NVTX_INJECTION64_PATH names this library: on its first NVTX call the program dlopen()s it and
 * calls InitializeInjectionNvtx2(getExportTable) once per NVTX instance (every compiled module of
 * the program carries its own). We take the callback export table and put our functions into the
 * slots of the calls we record; NVTX turns every other slot into a no-op.
 *
 * Output: one text file per process, $NVTX_RECORD_DIR/nvtx.<pid>.tsv, one line per call, fields
 * separated by tabs (times: CLOCK_MONOTONIC in ns, the clock of Python's time.monotonic_ns):
 *
 *   T  <realtime ns> <monotonic ns>                         clock pair taken at start-up
 *   D  <tid> <t> <domain> <name>                            nvtxDomainCreateA (handle = domain id)
 *   S  <tid> <t> <domain> <string id> <text>                nvtxDomainRegisterStringA
 *   C  <tid> <t> <domain> <category id> <name>              nvtx[Domain]NameCategoryA
 *   P  <tid> <t> <domain> <attributes>                      nvtx[Domain]RangePushEx / RangePushA
 *   O  <tid> <t> <domain>                                   nvtx[Domain]RangePop
 *   A  <tid> <t> <domain> <range id> <attributes>           nvtx[Domain]RangeStartEx
 *   E  <tid> <t> <domain> <range id>                        nvtx[Domain]RangeEnd
 *
 * <attributes> = <category> <colorType> <color> <payloadType> <payload> <messageType> <message>;
 * a registered message is written as its string id, an ASCII one as its text. Domain 0 is
 * NVTX's default domain (the calls without a domain argument).
 */
#define _GNU_SOURCE
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static FILE* out = NULL;
static pid_t out_pid = 0;
static uint64_t next_domain = 1, next_string = 1, next_range = 1;

static uint64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The open output file of this process (re-opened in a forked child); call with the lock held. */
static FILE* file(void) {
    pid_t pid = getpid();
    if (out != NULL && out_pid == pid) return out;
    const char* dir = getenv("NVTX_RECORD_DIR");
    if (dir == NULL) return NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/nvtx.%d.tsv", dir, (int)pid);
    out = fopen(path, "a");
    out_pid = pid;
    if (out != NULL) fprintf(out, "T\t%" PRIu64 "\t%" PRIu64 "\n", now_ns(CLOCK_REALTIME), now_ns(CLOCK_MONOTONIC));
    return out;
}

/* Text without tabs or line breaks (they separate fields and records). */
static void put_text(FILE* f, const char* s) {
    for (; s != NULL && *s; ++s) fputc((*s == '\t' || *s == '\n' || *s == '\r') ? ' ' : *s, f);
}

static void head(FILE* f, char kind, uint64_t t, uint64_t domain) {
    fprintf(f, "%c\t%ld\t%" PRIu64 "\t%" PRIu64, kind, (long)syscall(SYS_gettid), t, domain);
}

static void put_attributes(FILE* f, const nvtxEventAttributes_t* a) {
    fprintf(f, "\t%" PRIu32 "\t%d\t%" PRIu32 "\t%d\t", a->category, a->colorType, a->color, a->payloadType);
    switch (a->payloadType) {
        case NVTX_PAYLOAD_TYPE_UNSIGNED_INT64: fprintf(f, "%" PRIu64, a->payload.ullValue); break;
        case NVTX_PAYLOAD_TYPE_INT64: fprintf(f, "%" PRId64, a->payload.llValue); break;
        case NVTX_PAYLOAD_TYPE_DOUBLE: fprintf(f, "%.17g", a->payload.dValue); break;
        case NVTX_PAYLOAD_TYPE_UNSIGNED_INT32: fprintf(f, "%" PRIu32, a->payload.uiValue); break;
        case NVTX_PAYLOAD_TYPE_INT32: fprintf(f, "%" PRId32, a->payload.iValue); break;
        case NVTX_PAYLOAD_TYPE_FLOAT: fprintf(f, "%.9g", (double)a->payload.fValue); break;
        default: break;
    }
    fprintf(f, "\t%d\t", a->messageType);
    if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED)
        fprintf(f, "%" PRIu64, (uint64_t)(uintptr_t)a->message.registered);
    else if (a->messageType == NVTX_MESSAGE_TYPE_ASCII)
        put_text(f, a->message.ascii);
}

static void finish(FILE* f) {
    fputc('\n', f);
    fflush(f);  /* a rank killed at the end of a test still leaves its complete lines */
}

static uint64_t domain_id(nvtxDomainHandle_t d) { return (uint64_t)(uintptr_t)d; }

/* ---- recorded calls ---------------------------------------------------------------------- */

static nvtxDomainHandle_t NVTX_API domain_create(const char* name) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    uint64_t id = next_domain++;
    FILE* f = file();
    if (f) { head(f, 'D', t, id); fputc('\t', f); put_text(f, name); finish(f); }
    pthread_mutex_unlock(&lock);
    return (nvtxDomainHandle_t)(uintptr_t)id;
}

static nvtxStringHandle_t NVTX_API register_string(nvtxDomainHandle_t d, const char* s) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    uint64_t id = next_string++;
    FILE* f = file();
    if (f) { head(f, 'S', t, domain_id(d)); fprintf(f, "\t%" PRIu64 "\t", id); put_text(f, s); finish(f); }
    pthread_mutex_unlock(&lock);
    return (nvtxStringHandle_t)(uintptr_t)id;
}

static void name_category(uint64_t domain, uint32_t category, const char* name) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    FILE* f = file();
    if (f) { head(f, 'C', t, domain); fprintf(f, "\t%" PRIu32 "\t", category); put_text(f, name); finish(f); }
    pthread_mutex_unlock(&lock);
}

static int push(uint64_t domain, const nvtxEventAttributes_t* a) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    FILE* f = file();
    if (f) { head(f, 'P', t, domain); put_attributes(f, a); finish(f); }
    pthread_mutex_unlock(&lock);
    return 0;
}

static int pop(uint64_t domain) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    FILE* f = file();
    if (f) { head(f, 'O', t, domain); finish(f); }
    pthread_mutex_unlock(&lock);
    return 0;
}

static nvtxRangeId_t start(uint64_t domain, const nvtxEventAttributes_t* a) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    uint64_t id = next_range++;
    FILE* f = file();
    if (f) { head(f, 'A', t, domain); fprintf(f, "\t%" PRIu64, id); put_attributes(f, a); finish(f); }
    pthread_mutex_unlock(&lock);
    return id;
}

static void end(uint64_t domain, nvtxRangeId_t id) {
    uint64_t t = now_ns(CLOCK_MONOTONIC);
    pthread_mutex_lock(&lock);
    FILE* f = file();
    if (f) { head(f, 'E', t, domain); fprintf(f, "\t%" PRIu64, (uint64_t)id); finish(f); }
    pthread_mutex_unlock(&lock);
}

static int NVTX_API d_push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) { return push(domain_id(d), a); }
static int NVTX_API d_pop(nvtxDomainHandle_t d) { return pop(domain_id(d)); }
static nvtxRangeId_t NVTX_API d_start(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) { return start(domain_id(d), a); }
static void NVTX_API d_end(nvtxDomainHandle_t d, nvtxRangeId_t id) { end(domain_id(d), id); }
static void NVTX_API d_category(nvtxDomainHandle_t d, uint32_t c, const char* n) { name_category(domain_id(d), c, n); }

static int NVTX_API g_push(const nvtxEventAttributes_t* a) { return push(0, a); }
static int NVTX_API g_push_a(const char* message) {
    nvtxEventAttributes_t a;
    memset(&a, 0, sizeof a);
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = message;
    return push(0, &a);
}
static int NVTX_API g_pop(void) { return pop(0); }
static nvtxRangeId_t NVTX_API g_start(const nvtxEventAttributes_t* a) { return start(0, a); }
static void NVTX_API g_end(nvtxRangeId_t id) { end(0, id); }
static void NVTX_API g_category(uint32_t c, const char* n) { name_category(0, c, n); }

/* ---- attach ------------------------------------------------------------------------------ */

static int attach(const NvtxExportTableCallbacks* cb, NvtxCallbackModule module, const unsigned int* ids,
                  NvtxFunctionPointer const* fns, unsigned int n) {
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!cb->GetModuleFunctionTable(module, &table, &size) || table == NULL) return 0;
    for (unsigned int i = 0; i < n; ++i) {
        if (ids[i] >= size || table[ids[i]] == NULL) return 0;
        *table[ids[i]] = fns[i];
    }
    return 1;
}

#define FN(f) ((NvtxFunctionPointer)(f))

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable) {
    const NvtxExportTableCallbacks* cb = (const NvtxExportTableCallbacks*)getExportTable(NVTX_ETID_CALLBACKS);
    if (cb == NULL || cb->struct_size < sizeof(NvtxExportTableCallbacks)) return 0;

    static const unsigned int core2_ids[] = {
        NVTX_CBID_CORE2_DomainCreateA, NVTX_CBID_CORE2_DomainRegisterStringA, NVTX_CBID_CORE2_DomainNameCategoryA,
        NVTX_CBID_CORE2_DomainRangePushEx, NVTX_CBID_CORE2_DomainRangePop, NVTX_CBID_CORE2_DomainRangeStartEx,
        NVTX_CBID_CORE2_DomainRangeEnd,
    };
    NvtxFunctionPointer core2_fns[] = {
        FN(domain_create), FN(register_string), FN(d_category), FN(d_push), FN(d_pop), FN(d_start), FN(d_end),
    };
    static const unsigned int core_ids[] = {
        NVTX_CBID_CORE_RangePushEx, NVTX_CBID_CORE_RangePushA, NVTX_CBID_CORE_RangePop,
        NVTX_CBID_CORE_RangeStartEx, NVTX_CBID_CORE_RangeEnd, NVTX_CBID_CORE_NameCategoryA,
    };
    NvtxFunctionPointer core_fns[] = {
        FN(g_push), FN(g_push_a), FN(g_pop), FN(g_start), FN(g_end), FN(g_category),
    };
    pthread_mutex_lock(&lock);
    file();  /* the clock pair first */
    pthread_mutex_unlock(&lock);
    return attach(cb, NVTX_CB_MODULE_CORE2, core2_ids, core2_fns, sizeof core2_ids / sizeof *core2_ids)
        && attach(cb, NVTX_CB_MODULE_CORE, core_ids, core_fns, sizeof core_ids / sizeof *core_ids);
}
