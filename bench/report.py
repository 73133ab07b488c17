#!/usr/bin/python3
"""Renders a bench.py result (JSON) as the markdown tables of
docs/benchmarks.md.

usage: report.py [bench/results/latest.json]
"""

import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))


def s(x, f='%.3f'):
    return '-' if x is None else f % x


def ms(x):
    return '-' if x is None else '%.0f' % (1000 * x)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        ROOT, 'bench', 'results', 'latest.json')
    d = json.load(open(path))
    out = []
    m = d['machine']
    out.append('Measured %s on %d cores (%s), kernel %s; `%s`, %.0f s in all.'
               % (d['date'], m['cpus'], m['cpu'], m['kernel'],
                  'make bench', d['seconds']))
    out.append('')

    if 'ttft' in d:
        out.append('### 1. Returning-session time to first token')
        out.append('')
        out.append('Medians in ms over the sessions of a group (p95 in '
                   'brackets); "return" is a session\'s turn after every '
                   'other session had the slot, "hit" the same kind of turn '
                   'right after its own previous one, penalty = return - '
                   'hit, "restart" the next turn right after llama-server '
                   'restarted.')
        out.append('')
        out.append('| prompt | sessions | alone: return | native RAM cache: '
                   'return | module: return | module / alone | module / '
                   'native | penalty native | penalty module | restart: '
                   'alone | native | module |')
        out.append('|---|---|---|---|---|---|---|---|---|---|---|---|')
        for r in d['ttft']:
            a = r['sides']['alone']
            b = r['sides']['native_ram_cache']
            c = r['sides']['module']
            toks = (c['return_prompt_tokens'] or [r['prompt_tokens']])[0]
            out.append('| %s | %d | %s (%s) | %s (%s) | %s (%s) | %s | %s | '
                       '%s | %s | %s | %s | %s |'
                       % (toks, r['sessions'],
                          ms(a['return_median']), ms(a['return_p95']),
                          ms(b['return_median']), ms(b['return_p95']),
                          ms(c['return_median']), ms(c['return_p95']),
                          s(c['return_median'] / a['return_median']),
                          s(c['return_median'] / b['return_median']),
                          ms(b['swap_penalty']), ms(c['swap_penalty']),
                          ms(a['restart_median']), ms(b['restart_median']),
                          ms(c['restart_median'])))
        out.append('')

    if 'swap' in d:
        out.append('### 2. Swap overhead')
        out.append('')
        out.append('| page cache | module swap (ms) | raw save + restore '
                   '(ms) | module / raw | file |')
        out.append('|---|---|---|---|---|')
        for k in ('warm', 'cold'):
            r = d['swap'][k]
            out.append('| %s | %s (p95 %s) | %s (p95 %s) | %s | %d MB |'
                       % (k, s(1000 * r['module_median'], '%.1f'),
                          s(1000 * r['module_p95'], '%.1f'),
                          s(1000 * r['raw_median'], '%.1f'),
                          s(1000 * r['raw_p95'], '%.1f'), s(r['ratio']),
                          r['file_bytes'] // 2 ** 20))
        out.append('')

    if 'hit' in d:
        out.append('### 3. Hit path (fast backend, wrk -c1)')
        out.append('')
        out.append('| body | module req/s | plain req/s | ratio | module '
                   'p50 / p99 (ms) | plain p50 / p99 (ms) | p50 added '
                   '(ms) |')
        out.append('|---|---|---|---|---|---|---|')
        for k in ('2KB', '1MB'):
            r = d['hit'][k]
            mo, pl = r['module'], r['plain']
            out.append('| %s | %.0f | %.0f | %s | %s / %s | %s / %s | %s |'
                       % (k, mo['rps_median'], pl['rps_median'],
                          s(r['throughput_ratio']), s(mo['p50_ms_median']),
                          s(mo['p99_ms_median']), s(pl['p50_ms_median']),
                          s(pl['p99_ms_median']), s(r['p50_added_ms'])))
        out.append('')

    if 'scale' in d:
        out.append('### 4. Scale')
        out.append('')
        out.append('| sessions in the zone | shared memory per session '
                   '(bytes) | hit p50 (ms) | swap to a new session (ms) | '
                   'nginx start (s) |')
        out.append('|---|---|---|---|---|')
        for r in d['scale']:
            out.append('| %d | %s | %s | %s | %s |'
                       % (r['known'], s(r['shm_bytes_per_session'], '%.0f'),
                          s(r['hit_p50_ms']), s(r['swap_median_ms'], '%.2f'),
                          s(r['start_seconds'], '%.1f')))
        out.append('')

    if 'warm' in d:
        out.append('### 5. New conversations that share a system prompt')
        out.append('')
        out.append('Time to first token (ms, medians): the first turn of a '
                   'new conversation, and the next turn of the previous one '
                   'right after it; cached tokens of the new conversations\' '
                   'first turns in brackets.')
        out.append('')
        out.append('| system prompt | new: defaults | new: --cache-ram 0 | '
                   'new: module | module / defaults | returning: defaults | '
                   'returning: --cache-ram 0 | returning: module | module / '
                   'defaults | first conversation: defaults / module |')
        out.append('|---|---|---|---|---|---|---|---|---|---|')
        for r in d['warm']:
            a = r['sides']['defaults']
            b = r['sides']['cache_ram_0']
            c = r['sides']['module']
            out.append('| %d | %s (%s) | %s (%s) | %s (%s) | %s | %s | %s | '
                       '%s | %s | %s / %s |'
                       % (r['system_tokens'],
                          ms(a['new_median']), min(a['new_cache_n'] or [0]),
                          ms(b['new_median']), min(b['new_cache_n'] or [0]),
                          ms(c['new_median']), min(c['new_cache_n'] or [0]),
                          s(r['new_module_vs_defaults']),
                          ms(a['return_median']), ms(b['return_median']),
                          ms(c['return_median']),
                          s(r['return_module_vs_defaults']),
                          ms(a['first']), ms(c['first'])))
        out.append('')

    if 'team' in d:
        out.append('### 6. A team on four slots')
        out.append('')
        out.append('M sessions, 4 clients with 1 s of think time, 3 turns '
                   'a session; returning turns\' time to first token (ms, '
                   'p50 / p95), turns per minute, and the share of prompt '
                   'tokens of returning turns served from cache.')
        out.append('')
        out.append('| prompt | sessions | defaults | RAM for two | module | '
                   'module / RAM for two | module / defaults | turns/min '
                   'defaults / RAM for two / module | cached defaults / '
                   'RAM for two / module |')
        out.append('|---|---|---|---|---|---|---|---|---|')
        for r in d['team']:
            a = r['sides']['defaults']
            b = r['sides']['ram_two_sessions']
            c = r['sides']['module']
            out.append('| %d | %d | %s / %s | %s / %s | %s / %s | %s | %s | '
                       '%.1f / %.1f / %.1f | %s / %s / %s |'
                       % (r['prompt_tokens'], r['sessions'],
                          ms(a['return_p50']), ms(a['return_p95']),
                          ms(b['return_p50']), ms(b['return_p95']),
                          ms(c['return_p50']), ms(c['return_p95']),
                          s(r['module_vs_ram_two']),
                          s(r['module_vs_defaults']),
                          a['turns_per_minute'], b['turns_per_minute'],
                          c['turns_per_minute'],
                          s(a['cached_share'], '%.2f'),
                          s(b['cached_share'], '%.2f'),
                          s(c['cached_share'], '%.2f')))
        out.append('')

    if 'oneslot' in d:
        r = d['oneslot']
        a = r['sides']['native_ram_cache']
        c = r['sides']['module']
        out.append('### 7. One slot, two sessions of %d tokens'
                   % r['prompt_tokens'])
        out.append('')
        out.append('| side | samples | median (ms) | p95 | min / max | '
                   'stdev | swap (ms, median) |')
        out.append('|---|---|---|---|---|---|---|')
        for name, x in (('native RAM cache', a), ('module', c)):
            out.append('| %s | %d | %s | %s | %s / %s | %s | %s |'
                       % (name, x['samples'], ms(x['return_median']),
                          ms(x['return_p95']), ms(x['return_min']),
                          ms(x['return_max']), ms(x['stdev']),
                          s(x['swap_ms_median'], '%.0f')))
        out.append('')
        out.append('module / native: %s' % s(r['module_vs_native']))
        out.append('')

    print('\n'.join(out))


if __name__ == '__main__':
    main()
