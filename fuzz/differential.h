
/*
 * Between fuzz/differential.c (the module, C) and
 * fuzz/differential_fuzz.cc (llama-server's JSON library, C++).
 */


#ifndef _FUZZ_DIFFERENTIAL_H_INCLUDED_
#define _FUZZ_DIFFERENTIAL_H_INCLUDED_


#include <stddef.h>


#ifdef __cplusplus
extern "C" {
#endif


#define DIFF_NAMES  14

typedef struct {
    size_t          len;
    unsigned char   data[512];
} diff_str_t;

typedef struct {
    int             rc;                 /* identify's: 0 NGX_OK */
    int             probe;
    int             default_session;
    diff_str_t      model;
    diff_str_t      key;
    diff_str_t      id;
} diff_decision_t;

typedef struct {
    long            start;              /* offsets, -1: no member */
    long            end;
} diff_span_t;


const char *diff_name(int set, int i);   /* set 0: top, 1: message,
                                           2: metadata */
int diff_identify(const unsigned char *data, size_t size, const char *uri,
    diff_decision_t *d);
int diff_object(const unsigned char *data, size_t size, int whole, int set,
    diff_span_t *spans);
int diff_elements(const unsigned char *data, size_t size, diff_span_t *elts,
    int max);
int diff_string_is(const unsigned char *data, size_t size, const char *s);


#ifdef __cplusplus
}
#endif


#endif /* _FUZZ_DIFFERENTIAL_H_INCLUDED_ */
