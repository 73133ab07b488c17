#!/usr/bin/python3
"""make bench: what the module buys and what it costs, side by side.

1. ttft   returning-session time to first token: llama-server alone,
          llama-server with its RAM prompt cache, nginx + module; and each
          right after llama-server restarts; with the swap penalty (the
          returning turn minus the same kind of turn when the slot already
          holds the session)
2. swap   the module's swap against the raw /slots save + restore of the
          same files, warm and cold page cache
3. hit    the hit path against a fast backend: nginx + module against
          plain proxy_pass, with wrk, 2 KB and 1 MB bodies
4. scale  shared memory per session and hit-path latency with 1k, 10k and
          100k sessions known to the zone
5. warm   the first turn of new conversations that share a 2k, 8k and 16k
          token system prompt, interleaved with returning turns of older
          ones: nginx + module against llama-server alone at its defaults
          and with --cache-ram 0
7. oneslot  one slot, two sessions of about 8.5k tokens taking turns, 24
          returning turns a side: llama-server's RAM cache (two sessions'
          budget) against the module with idle saves; where the module's
          time goes (its swap: GET /slots and the restore; the rest)
8. models the memory kinds (the rig's llama: full attention, lfm2: hybrid,
          gemma3: sliding window) with ChatML and a reasoning template: two
          sessions on one slot taking turns; the returning turns' reuse of
          the history they share with the previous turn and their time to
          first token, through the module against llama-server alone at its
          defaults and with --cache-ram 0
9. kvq    slot files and restores with the KV cache in f16 and q8_0
10. clients  the agent CLIs' own requests (t/data: Claude Code's
          /v1/messages, Codex's /v1/responses, and a chat client's
          /v1/chat/completions with the same prompt), replayed with their
          headers on one slot: two conversations taking turns, a third
          one, the first one back; each new and returning turn's time to
          first token, nginx + module (llama_session_warm system) against
          llama-server alone at its defaults
11. draft the rig's model as its own draft (-md, draft-simple): draft
          tokens accepted and generation speed on a session's turns kept in
          its slot, right after a restore (erase, restore), the turn after
          that, and after a full re-prefill (not in the default list:
          --only draft)
12. returning  the returning turn's time to first token, p50 and p95:
          llama-server alone at its defaults against the module's zone at
          its defaults and with save_idle=1s; one slot with one client, four
          slots with twelve clients at once (not in the default list:
          --only returning)
6. team   M sessions on 4 slots (-np 4), 4 clients with think time:
          llama-server alone at its defaults, with a RAM budget of two
          sessions, and nginx + module (slots=4), M = 4, 8, 16

Every comparison runs in one process, its sides alternating request by
request.  Results: a table on stdout and JSON (--out).

13. fleet three llama-servers of one model behind owner zones and a
          front, sessions of unequal size, twelve clients at once: the
          sticky hash with a folder per owner, with one shared folder
          (shared=on), and least_conn with it; returning turns' time to
          first token, hit/restore/fresh, and the tokens each owner held
          and prefilled (--only fleet)
14. balance four owners of two slots over one store, twenty sessions
          (four hot, three of one home), the same seeded schedule on
          each side: hash consistent, least_conn, llama_session_balance,
          the balancer without residency, and the balancer on two edge
          nginx instances before the owners' (turns alternate edges);
          returning turns' time to first token, hits, re-prefills,
          in-flight and prefilled tokens per owner, max over mean
          (--only balance, BENCH_SEEDS=1,2,3; one thread a llama-server,
          BENCH_THREADS; the store at 128 MB/s through t/hangfs.py and no
          flash attention, so a restore costs what a real model's does:
          BENCH_STORE_RATE, BENCH_FA; the owners' save_idle=2s:
          BENCH_SAVE_IDLE)

usage: bench.py [--out FILE] [--only ttft,swap,hit,scale,warm,team,oneslot,models,kvq,clients,draft,returning,fleet,balance] [--quick]
"""

import argparse
import hashlib
import http.client
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..'))
NGINX = os.environ.get('NGINX_BINARY', '/usr/sbin/nginx')
MODULE = os.environ.get('NGINX_MODULE',
                        os.path.join(ROOT, 'objs',
                                     'ngx_http_llama_session_module.so'))


# random weights: byte tokens make invalid UTF-8, which the chat parser
# refuses with 500; they are banned in the requests of bench_models
BAN = [[i, False] for i in range(3, 259)]


def rig(script, *args):
    return subprocess.check_output([os.path.join(ROOT, 'rig', script)]
                                   + list(args),
                                   stderr=subprocess.DEVNULL).decode().strip()


def free_port():
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_http(port, path='/health', timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        try:
            c = http.client.HTTPConnection('127.0.0.1', port, timeout=2)
            c.request('GET', path)
            r = c.getresponse()
            r.read()
            c.close()
            if r.status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError('nothing answers on port %d' % port)


def median(xs):
    return statistics.median(xs) if xs else None


def p95(xs):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


class Llama:
    """a real llama-server of the rig"""

    def __init__(self, work, name, ctx, cache_ram=0, args=None, np=1,
                 model=None, extra=(), slots=None, ram=0, threads=2):
        self.name = name
        self.port = free_port()
        self.slots = slots or os.path.join(work, name + '-slots')
        os.makedirs(self.slots, exist_ok=True)
        self.log = open(os.path.join(work, name + '.log'), 'ab')
        self.args = [rig('build-llama-server.sh'), '-m',
                     model or rig('make-model.sh'),
                     '--host', '127.0.0.1', '--port', str(self.port),
                     '-np', str(np), '-c', str(ctx), '--slot-save-path',
                     self.slots, '-t', str(threads), '--no-webui']
        if args is not None:
            # llama-server as it is run without the module
            self.args += args
        elif ram:
            # the module's two tiers (ram= of the zone): llama-server's RAM
            # cache, looked into when a pinned request displaces a slot
            self.args += ['--no-kv-unified', '--no-cache-idle-slots',
                          '-sps', '0.1', '--cache-ram', str(ram)]
        elif cache_ram:
            # llama-server's own RAM prompt cache, as deployed: its defaults
            # (prompt similarity, idle slots cached) with a budget
            self.args += ['--cache-ram', str(cache_ram)]
        else:
            # what the module expects
            self.args += ['--no-kv-unified', '--no-cache-idle-slots',
                          '-sps', '0', '--cache-ram', '0']
        # the model's own flags (a template, --swa-full), on every side
        self.args += list(extra)
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=self.log,
                                     stderr=self.log)
        wait_http(self.port)

    def restart(self):
        self.stop()
        self.start()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class Nginx:
    def __init__(self, work, name, http_conf, workers=2):
        self.dir = os.path.join(work, name)
        os.makedirs(os.path.join(self.dir, 'tmp'), exist_ok=True)
        with open(os.path.join(self.dir, 'nginx.conf'), 'w') as f:
            f.write(
                'load_module %s;\nworker_processes %d;\nmaster_process on;\n'
                'daemon off;\npid %s/nginx.pid;\nerror_log %s/error.log info;'
                '\nuser root;\nevents { worker_connections 1024; }\n'
                'http {\n    access_log off;\n'
                '    client_body_temp_path %s/tmp/body;\n'
                '    proxy_temp_path %s/tmp/proxy;\n%s\n}\n'
                % (MODULE, workers, self.dir, self.dir, self.dir, self.dir,
                   http_conf))
        self.out = open(os.path.join(self.dir, 'nginx.out'), 'ab')
        self.proc = subprocess.Popen(
            [NGINX, '-p', self.dir + '/', '-c',
             os.path.join(self.dir, 'nginx.conf'), '-e',
             os.path.join(self.dir, 'error.log')],
            stdout=self.out, stderr=self.out)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def module_nginx(work, name, llama, server='', zone='save_idle=500ms'):
    """nginx + module in front of one llama-server of the rig, one slot,
    idle saves after 500 ms (zone: the zone's parameters; server: more of
    the server block): (the Nginx, its port)"""
    nport = free_port()
    ngx = Nginx(work, name, '''
    llama_session_zone zone=llama:4m store=%s %s;
    server {
        listen 127.0.0.1:%d;
        %s
        location / {
            llama_session llama;
            proxy_pass http://127.0.0.1:%d;
            proxy_buffering off;
            proxy_read_timeout 900s;
            add_header X-S-Action $llama_session_action always;
            add_header X-S-Swap $llama_session_swap_ms always;
        }
        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%d/;
            proxy_read_timeout 900s;
        }
    }''' % (llama.slots, zone, nport, server, llama.port, llama.port))
    wait_http(nport)
    return ngx, nport


def post(port, path, body, headers=None, timeout=600):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=timeout)
    h = {'Content-Type': 'application/json'}
    h.update(headers or {})
    c.request('POST', path, data, h)
    r = c.getresponse()
    payload = r.read()
    c.close()
    return r.status, dict(r.getheaders()), payload


def stream_turn(port, messages, sid):
    """a streamed chat turn: (ttft seconds, reply text, cache_n, headers,
    prompt tokens)"""
    ttft, text, cache_n, prompt, _, hdrs = chat_turn(
        port, messages, sid, 4, {'temperature': 0})
    return ttft, text, cache_n, hdrs, prompt


def words_for(port, tokens, prefix):
    """how many filler words make a first turn of about this many tokens"""
    nwords = 1000
    for _ in range(3):
        msgs = [{'role': 'system', 'content': filler('sys', nwords // 4)},
                {'role': 'user', 'content':
                 filler(prefix, nwords * 3 // 4) + ' Q1?'}]
        st, _, payload = post(port, '/apply-template', {'messages': msgs})
        prompt = json.loads(payload)['prompt']
        st, _, payload = post(port, '/tokenize', {'content': prompt})
        n = len(json.loads(payload)['tokens'])
        nwords = int(nwords * tokens / n)
    return nwords


def filler(prefix, n):
    return ' '.join('%s%d' % (prefix, i) for i in range(n))


# 1. returning-session time to first token ---------------------------------

def bench_ttft(work, quick, full=False):
    # prefill grows faster than linearly: 2k tokens take 0.6 s here, 8k
    # 6 s, 16k about 20 s, and the two llama-server sides re-prefill every
    # returning turn; the default grid keeps make bench within 15 minutes
    grid = [(2048, [2, 4, 8]), (8192, [2, 4]), (16384, [2])]
    if full:
        grid = [(2048, [2, 4, 8]), (8192, [2, 4, 8]), (16384, [2, 4, 8])]
    if quick:
        grid = [(2048, [2])]
    kv_per_token = 8.3 * 1024          # the rig model, measured
    results = []

    for ptoks, ns in grid:
        ctx = max(4096, ptoks * 5 // 4 + 512)
        # the native RAM cache holds two sessions of this size (it saves
        # the outgoing state before it loads the incoming one)
        cache_mib = int(2.5 * ptoks * kv_per_token / 2 ** 20) + 8
        alone = Llama(work, 'alone-%d' % ptoks, ctx)
        native = Llama(work, 'native-%d' % ptoks, ctx, cache_ram=cache_mib)
        withmod = Llama(work, 'module-%d' % ptoks, ctx)
        ngx, nport = module_nginx(work, 'nginx-ttft-%d' % ptoks, withmod)

        sides = [('alone', alone.port), ('native_ram_cache', native.port),
                 ('module', nport)]

        for n in ns:
            # a shared system prompt of a quarter and each session's own
            # history: llama-server's RAM cache moves a slot's state out
            # only when less than half of it is kept (f_keep < 0.5)
            sessions = ['p%dn%ds%d' % (ptoks, n, i) for i in range(n)]
            nwords = words_for(alone.port, ptoks, sessions[0] + 'h')
            system = filler('sys', nwords // 4)
            conv = {(s, sid): [{'role': 'system', 'content': system},
                               {'role': 'user', 'content':
                                filler(sid + 'h', nwords * 3 // 4)
                                + ' Q1?'}]
                    for s, _ in sides for sid in sessions}
            rec = {s: {'fresh': [], 'hit': [], 'return': [],
                       'restart': [], 'return_cache_n': [],
                       'prompt_tokens': []} for s, _ in sides}

            def turn(side, port, sid, kind, question):
                msgs = conv[(side, sid)]
                if question:
                    msgs.append({'role': 'user', 'content':
                                 question + ' ' + filler('q', 8)})
                ttft, text, cache_n, _, prompt_n = stream_turn(port, msgs,
                                                               sid)
                msgs.append({'role': 'assistant', 'content': text})
                rec[side][kind].append(ttft)
                if os.environ.get('BENCH_DEBUG'):
                    print('  %s %s %s: %.3f s, %s tokens, %s cached'
                          % (side, sid, kind, ttft, prompt_n, cache_n))
                if kind == 'return':
                    rec[side]['return_cache_n'].append(cache_n)
                    rec[side]['prompt_tokens'].append(prompt_n)
                return ttft

            # first turns (fresh) and the hit floor (the next turn at once)
            for sid in sessions:
                for side, port in sides:
                    turn(side, port, sid, 'fresh', None)
                    turn(side, port, sid, 'hit', 'Q2?')

            # each session returns after the others had the slot
            for sid in sessions:
                for side, port in sides:
                    turn(side, port, sid, 'return', 'Q3?')

            # after llama-server restarts (the smallest group only; one
            # session of the largest prompts)
            if n == ns[0]:
                for srv in (alone, native, withmod):
                    srv.restart()
                for sid in sessions[:1 if ptoks > 8192 else None]:
                    for side, port in sides:
                        turn(side, port, sid, 'restart', 'Q4?')

            row = {'prompt_tokens': ptoks, 'sessions': n, 'sides': {}}
            for side, _ in sides:
                r = rec[side]
                row['sides'][side] = {
                    'fresh_median': median(r['fresh']),
                    'hit_median': median(r['hit']),
                    'return_median': median(r['return']),
                    'return_p95': p95(r['return']),
                    'restart_median': median(r['restart']),
                    'swap_penalty': (median(r['return']) - median(r['hit'])),
                    'restart_penalty': (median(r['restart']) - median(r['hit'])
                                        if r['restart'] else None),
                    'samples': len(r['return']),
                    'return_cache_n': r['return_cache_n'],
                    'return_prompt_tokens': r['prompt_tokens'],
                }
            results.append(row)
            print_ttft_row(row)

        ngx.stop()
        for srv in (alone, native, withmod):
            srv.stop()
            shutil.rmtree(srv.slots, ignore_errors=True)

    return results


def print_ttft_row(row):
    s = row['sides']
    m, a, b = s['module'], s['alone'], s['native_ram_cache']
    print('ttft  %5d tok x %d sessions | return ttft (s) alone %.3f  native '
          '%.3f  module %.3f | module/alone %.3f  module/native %.3f | '
          'penalty (s) native %.3f  module %.3f | after restart: alone %s  '
          'native %s  module %s'
          % (row['prompt_tokens'], row['sessions'], a['return_median'],
             b['return_median'], m['return_median'],
             m['return_median'] / a['return_median'],
             m['return_median'] / b['return_median'],
             b['swap_penalty'], m['swap_penalty'],
             fmt(a['restart_median']), fmt(b['restart_median']),
             fmt(m['restart_median'])), flush=True)


def fmt(x, f='%.3f'):
    return '-' if x is None else f % x


# 2. swap overhead ----------------------------------------------------------

def evict(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def bench_swap(work, quick):
    ptoks = 4096
    llama = Llama(work, 'swap', 8192)
    nport = free_port()
    ngx = Nginx(work, 'nginx-swap', '''
    llama_session_zone zone=llama:1m store=%s;
    server {
        listen 127.0.0.1:%d;
        location / {
            llama_session llama;
            proxy_pass http://127.0.0.1:%d;
            add_header X-S-Swap $llama_session_swap_ms always;
            add_header X-S-Action $llama_session_action always;
        }
        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%d/;
        }
    }''' % (llama.slots, nport, llama.port, llama.port))
    wait_http(nport)

    nwords = words_for(llama.port, ptoks, 'X')
    msgs = {sid: [{'role': 'user', 'content': filler(sid, nwords)}]
            for sid in ('X', 'Y')}
    for sid in ('X', 'Y', 'X', 'Y'):
        stream_turn(nport, msgs[sid], sid)

    def file_of(sid):
        for f in os.listdir(llama.slots):
            if f.startswith(sid + '-') and f.endswith('.bin'):
                return os.path.join(llama.slots, f)
        raise RuntimeError('no file for ' + sid)

    res = {}
    rounds = 4 if quick else 8
    for cache in ('warm', 'cold'):
        mod, raw = [], []
        for i in range(rounds):
            # the slot holds Y (the module's last request); the module swaps
            # to X: save Y + restore X
            if cache == 'cold':
                evict(file_of('X'))
            st, h, _ = post(nport, '/v1/chat/completions',
                            {'messages': msgs['X'], 'max_tokens': 2},
                            {'X-Session-Id': 'X'})
            assert h.get('X-S-Action') == 'restore', h
            mod.append(float(h['X-S-Swap']) / 1000)

            # raw: the same work straight to llama-server (save the slot,
            # which holds X now, to a new file, then restore X's file again)
            copy = os.path.join(llama.slots, 'raw-copy.bin')
            if os.path.exists(copy):
                os.unlink(copy)
            if cache == 'cold':
                evict(file_of('X'))
            t0 = time.perf_counter()
            post(llama.port, '/slots/0?action=save',
                 {'filename': 'raw-copy.bin'})
            post(llama.port, '/slots/0?action=restore',
                 {'filename': os.path.basename(file_of('X'))})
            raw.append(time.perf_counter() - t0)

            # back to Y through the module, not measured
            post(nport, '/v1/chat/completions',
                 {'messages': msgs['Y'], 'max_tokens': 2},
                 {'X-Session-Id': 'Y'})
        res[cache] = {'module_median': median(mod), 'module_p95': p95(mod),
                      'raw_median': median(raw), 'raw_p95': p95(raw),
                      'ratio': median(mod) / median(raw),
                      'file_bytes': os.path.getsize(file_of('X')),
                      'samples': rounds}
        print('swap  %s page cache: module %.1f ms  raw save+restore %.1f ms'
              '  ratio %.3f  (%d MB files)'
              % (cache, 1000 * median(mod), 1000 * median(raw),
                 res[cache]['ratio'], res[cache]['file_bytes'] // 2 ** 20),
              flush=True)

    ngx.stop()
    llama.stop()
    shutil.rmtree(llama.slots, ignore_errors=True)
    return res


# 3. the hit path -----------------------------------------------------------

FAST_BACKEND = '''
    server {
        listen 127.0.0.1:%(backend)d;
        location = /slots {
            return 200 '[{"id":0,"n_ctx":4096,"is_processing":false}]';
        }
        location = /props {
            return 200 '{"model_path":"fast","total_slots":1,"default_generation_settings":{"n_ctx":4096}}';
        }
        location /slots/ { return 200 '{"id_slot":0,"n_erased":0}'; }
        location / {
            client_max_body_size 4m;
            return 200 '{"choices":[{"message":{"content":"ok"}}]}';
        }
    }
'''


def wrk(url, body_file, seconds, sid):
    script = body_file + '.lua'
    with open(script, 'w') as f:
        f.write('local f = io.open("%s", "rb")\n'
                'wrk.method = "POST"\nwrk.body = f:read("*a")\nf:close()\n'
                'wrk.headers["Content-Type"] = "application/json"\n'
                'wrk.headers["X-Session-Id"] = "%s"\n' % (body_file, sid))
    out = subprocess.check_output(['wrk', '-t1', '-c1', '-d%ds' % seconds,
                                   '--latency', '-s', script, url]).decode()
    rps = float(out.split('Requests/sec:')[1].split()[0])
    lat = {}
    for line in out.splitlines():
        line = line.strip()
        for q in ('50%', '99%'):
            if line.startswith(q):
                v = line.split()[1]
                lat[q] = (float(v[:-2]) / 1000 if v.endswith('us')
                          else float(v[:-2]) if v.endswith('ms')
                          else float(v[:-1]) * 1000)
    errors = 'Non-2xx' in out
    return rps, lat['50%'], lat['99%'], errors


def bench_hit(work, quick):
    backend, mport, pport = free_port(), free_port(), free_port()
    conf = FAST_BACKEND % {'backend': backend} + '''
    llama_session_zone zone=llama:1m;
    upstream fast { server 127.0.0.1:%(backend)d; keepalive 8; keepalive_timeout 4s; }
    server {
        listen 127.0.0.1:%(mport)d;
        client_max_body_size 4m;
        location / {
            llama_session llama;
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
        location /_llama_slots/ {
            internal;
            proxy_pass http://fast/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
    server {
        listen 127.0.0.1:%(pport)d;
        client_max_body_size 4m;
        location / {
            proxy_pass http://fast;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }''' % {'backend': backend, 'mport': mport, 'pport': pport}
    ngx = Nginx(work, 'nginx-hit', conf, workers=1)
    wait_http(pport, '/')
    res = {}
    seconds = 2 if quick else 5
    for label, size in (('2KB', 2048), ('1MB', 1024 * 1024)):
        body = json.dumps({'model': 'm', 'messages': [
            {'role': 'user', 'content': 'x' * (size - 60)}]})
        path = os.path.join(work, 'body-%s.json' % label)
        with open(path, 'w') as f:
            f.write(body)
        sides = {'module': [], 'plain': []}
        # warm up: the first module request takes the slot
        post(mport, '/v1/chat/completions', body.encode(),
             {'X-Session-Id': 'hit'})
        for rnd in range(3):
            for side, port in (('module', mport), ('plain', pport)):
                sides[side].append(wrk('http://127.0.0.1:%d/v1/chat/'
                                       'completions' % port, path, seconds,
                                       'hit'))
        r = {}
        for side in sides:
            runs = sides[side]
            r[side] = {'rps_median': median([x[0] for x in runs]),
                       'p50_ms_median': median([x[1] for x in runs]),
                       'p99_ms_median': median([x[2] for x in runs]),
                       'errors': any(x[3] for x in runs)}
        r['throughput_ratio'] = (r['module']['rps_median']
                                 / r['plain']['rps_median'])
        r['p50_added_ms'] = (r['module']['p50_ms_median']
                             - r['plain']['p50_ms_median'])
        res[label] = r
        print('hit   %s bodies: module %.0f req/s p50 %.3f ms p99 %.3f ms | '
              'plain %.0f req/s p50 %.3f ms p99 %.3f ms | throughput ratio '
              '%.3f, p50 added %.3f ms'
              % (label, r['module']['rps_median'], r['module']['p50_ms_median'],
                 r['module']['p99_ms_median'], r['plain']['rps_median'],
                 r['plain']['p50_ms_median'], r['plain']['p99_ms_median'],
                 r['throughput_ratio'], r['p50_added_ms']), flush=True)
    ngx.stop()
    return res


# 4. scale --------------------------------------------------------------------

def bench_scale(work, quick):
    counts = [0, 1000, 10000] + ([] if quick else [100000])
    fp = hashlib.sha256(b'fast\x004096\x001').hexdigest()[:8]
    res = []
    body = os.path.join(work, 'body-scale.json')
    with open(body, 'w') as f:
        f.write(json.dumps({'messages': [{'role': 'user', 'content': 'hi'}]}))
    for n in counts:
        store = os.path.join(work, 'scale-store')
        shutil.rmtree(store, ignore_errors=True)
        os.makedirs(store)
        for i in range(n):
            open(os.path.join(store, 'bulk%06d-%024x.%s.bin' % (i, i, fp)),
                 'w').close()
        backend, mport, aport = free_port(), free_port(), free_port()
        conf = FAST_BACKEND % {'backend': backend} + '''
    llama_session_zone zone=llama:96m store=%(store)s;
    server {
        listen 127.0.0.1:%(mport)d;
        location / {
            llama_session llama;
            proxy_pass http://127.0.0.1:%(backend)d;
        }
        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%(backend)d/;
        }
    }
    server {
        listen 127.0.0.1:%(aport)d;
        location /api/ { llama_session_api llama; }
    }''' % {'backend': backend, 'mport': mport, 'aport': aport,
            'store': store}
        t0 = time.perf_counter()
        ngx = Nginx(work, 'nginx-scale-%d' % n, conf, workers=1)
        wait_http(aport, '/api/sessions/current')
        start_s = time.perf_counter() - t0
        post(mport, '/v1/chat/completions', open(body, 'rb').read(),
             {'X-Session-Id': 'hit'})
        c = http.client.HTTPConnection('127.0.0.1', aport)
        c.request('GET', '/api/sessions/current')
        cur = json.loads(c.getresponse().read())
        c.close()
        rps, p50, p99, _ = wrk('http://127.0.0.1:%d/v1/chat/completions'
                               % mport, body, 2 if quick else 3, 'hit')
        # a swap to a new session: the slot decision with the index full
        swap = []
        for i in range(20):
            t1 = time.perf_counter()
            post(mport, '/v1/chat/completions', open(body, 'rb').read(),
                 {'X-Session-Id': 'new%d' % i})
            swap.append(time.perf_counter() - t1)
        ngx.stop()
        res.append({'sessions': n, 'known': cur['sessions'],
                    'shm_used_bytes': cur['shm_used_bytes'],
                    'start_seconds': start_s, 'hit_p50_ms': p50,
                    'hit_p99_ms': p99, 'swap_median_ms': 1000 * median(swap)})
        shutil.rmtree(store, ignore_errors=True)
    base = res[0]['shm_used_bytes']
    for r in res:
        r['shm_bytes_per_session'] = ((r['shm_used_bytes'] - base) / r['known']
                                      if r['known'] else None)
        print('scale %6d sessions: %s shm bytes/session, hit p50 %.3f ms, '
              'swap to a new session %.2f ms, start %.1f s'
              % (r['sessions'], fmt(r['shm_bytes_per_session'], '%.0f'),
                 r['hit_p50_ms'], r['swap_median_ms'], r['start_seconds']),
              flush=True)
    return res


# 5. warm starts: new conversations that share a system prompt -------------

def bench_warm(work, quick):
    grid = [2048] if quick else [2048, 8192, 16384]
    nconv = 4
    results = []

    for stoks in grid:
        ctx = stoks + 4096
        # at its defaults (RAM cache of 8 GiB, prompt similarity, idle
        # slots cached), with --cache-ram 0 alone, and as the module wants
        defaults = Llama(work, 'warm-defaults-%d' % stoks, ctx, args=[])
        noram = Llama(work, 'warm-noram-%d' % stoks, ctx,
                      args=['--cache-ram', '0'])
        withmod = Llama(work, 'warm-module-%d' % stoks, ctx)
        ngx, nport = module_nginx(work, 'nginx-warm-%d' % stoks, withmod)
        sides = [('defaults', defaults.port), ('cache_ram_0', noram.port),
                 ('module', nport)]

        # a system prompt of about stoks tokens; each conversation's own
        # first message of about 512 tokens.  The module saves idle
        # sessions after 500 ms, as deployed (save_idle): the other sides'
        # turns give it that time between its own
        nwords = words_for(noram.port, stoks, 'sys')
        system = filler('sys', nwords)
        own = max(64, nwords * 512 // stoks)
        rec = {s: {'new': [], 'new_cache_n': [], 'return': [],
                   'return_cache_n': [], 'first': None} for s, _ in sides}
        conv = {}

        def turn(side, port, i, kind):
            key = (side, i)
            if key not in conv:
                conv[key] = [{'role': 'system', 'content': system},
                             {'role': 'user', 'content':
                              filler('c%dw' % i, own) + ' Q1?'}]
            else:
                conv[key].append({'role': 'user', 'content':
                                  'Q%d? %s' % (len(conv[key]),
                                               filler('q', 8))})
            ttft, text, cache_n, hdrs, _ = stream_turn(port, conv[key],
                                                       'conv-%d' % i)
            conv[key].append({'role': 'assistant', 'content': text})
            if os.environ.get('BENCH_DEBUG'):
                print('  %s %d %s: %.3f s, %s cached, %s, swap %s ms'
                      % (side, i, kind, ttft, cache_n,
                         hdrs.get('X-S-Action'), hdrs.get('X-S-Swap')))
            if kind == 'first':
                rec[side]['first'] = ttft
            else:
                rec[side][kind].append(ttft)
                rec[side][kind + '_cache_n'].append(cache_n)

        # the first conversation computes the system prompt everywhere;
        # then each new one comes, and an older one returns after it
        for side, port in sides:
            turn(side, port, 0, 'first')
        for i in range(1, nconv + 1):
            for side, port in sides:
                turn(side, port, i, 'new')
            for side, port in sides:
                turn(side, port, i - 1, 'return')

        row = {'system_tokens': stoks, 'conversations': nconv, 'sides': {}}
        for side, _ in sides:
            r = rec[side]
            row['sides'][side] = {
                'first': r['first'],
                'new_median': median(r['new']),
                'new_cache_n': r['new_cache_n'],
                'return_median': median(r['return']),
                'return_cache_n': r['return_cache_n'],
            }
        d = row['sides']
        row['new_module_vs_defaults'] = (d['module']['new_median']
                                         / d['defaults']['new_median'])
        row['return_module_vs_defaults'] = (d['module']['return_median']
                                            / d['defaults']['return_median'])
        results.append(row)
        print('warm %5d-token system prompt: new conversation %s / %s / %s '
              's (defaults / --cache-ram 0 / module), returning %s / %s / %s'
              % (stoks, fmt(d['defaults']['new_median']),
                 fmt(d['cache_ram_0']['new_median']),
                 fmt(d['module']['new_median']),
                 fmt(d['defaults']['return_median']),
                 fmt(d['cache_ram_0']['return_median']),
                 fmt(d['module']['return_median'])))

        ngx.stop()
        for srv in (defaults, noram, withmod):
            srv.stop()
            shutil.rmtree(srv.slots, ignore_errors=True)

    return results


# 7. one slot, enough samples ---------------------------------------------

def bench_oneslot(work, quick):
    ptoks = 2048 if quick else 8704
    turns = 6 if quick else 24
    kv_per_token = 8.3 * 1024
    ctx = ptoks * 3 // 2 + 2048
    cache_mib = int(2.5 * ptoks * kv_per_token / 2 ** 20) + 8
    native = Llama(work, 'one-native', ctx, cache_ram=cache_mib)
    withmod = Llama(work, 'one-module', ctx)
    ngx, nport = module_nginx(work, 'nginx-one', withmod)
    # the zone's defaults: no save_idle, the save on the client's path
    withdef = Llama(work, 'one-defaults', ctx)
    ngxd, nportd = module_nginx(work, 'nginx-one-defaults', withdef, zone='')
    sides = [('native_ram_cache', native.port), ('module', nport),
             ('module_defaults', nportd)]
    servers, procs = [native, withmod, withdef], []
    if os.environ.get('BENCH_PROXYCACHE'):
        # airnsk/proxycache (Python, FastAPI), a checkout of it named by
        # the variable, in front of llama-server at its defaults as its
        # README runs it (-np 1 --slot-save-path)
        pc = Llama(work, 'one-proxycache', ctx, args=[])
        servers.append(pc)
        pport = free_port()
        procs.append(subprocess.Popen(
            ['/usr/bin/python3', '-m', 'uvicorn', 'app:app', '--host',
             '127.0.0.1', '--port', str(pport)],
            cwd=os.environ['BENCH_PROXYCACHE'],
            env=dict(os.environ, LLAMA_URL='http://127.0.0.1:%d' % pc.port,
                     N_SLOTS='1', META_DIR=os.path.join(work, 'pc-meta')),
            stdout=pc.log, stderr=pc.log))
        wait_http(pport, '/v1/models')
        sides.append(('proxycache', pport))
    nwords = words_for(withmod.port, ptoks, 'oneA')
    system = filler('sys', nwords // 4)
    conv = {(s, sid): [{'role': 'system', 'content': system},
                       {'role': 'user', 'content':
                        filler(sid + 'h', nwords * 3 // 4) + ' Q1?'}]
            for s, _ in sides for sid in ('A', 'B')}
    rec = {s: {'return': [], 'swap_ms': [], 'cache_n': []} for s, _ in sides}

    def turn(side, port, sid, n, keep):
        msgs = conv[(side, sid)]
        if n:
            msgs.append({'role': 'user', 'content':
                         'Q%d? %s' % (n + 1, filler('q', 8))})
        ttft, text, cache_n, hdrs, _ = stream_turn(port, msgs, sid)
        msgs.append({'role': 'assistant', 'content': text})
        if keep:
            rec[side]['return'].append(ttft)
            rec[side]['cache_n'].append(cache_n)
            if hdrs.get('X-S-Swap'):
                rec[side]['swap_ms'].append(float(hdrs['X-S-Swap']))

    for sid in ('A', 'B'):
        for side, port in sides:
            turn(side, port, sid, 0, False)
    for n in range(1, turns // 2 + 1):
        for sid in ('A', 'B'):
            for side, port in sides:
                turn(side, port, sid, n, True)
            time.sleep(0.6)         # think time: the idle save runs

    res = {'prompt_tokens': ptoks, 'sides': {}}
    for side, _ in sides:
        r = rec[side]
        xs = sorted(r['return'])
        res['sides'][side] = {
            'return_median': median(xs), 'return_p95': p95(xs),
            'return_min': xs[0], 'return_max': xs[-1],
            'samples': len(xs),
            'stdev': statistics.pstdev(xs) if len(xs) > 1 else 0,
            'swap_ms_median': median(r['swap_ms']) if r['swap_ms'] else None,
            'cache_n_min': min([c for c in r['cache_n'] if c is not None]
                               or [None]),
        }
    d = res['sides']
    res['module_vs_native'] = (d['module']['return_median']
                               / d['native_ram_cache']['return_median'])
    print('oneslot %d tokens, %d returning turns a side: median / p95 (s) '
          '%s; module swap %s ms, defaults %s ms'
          % (ptoks, d['module']['samples'],
             ', '.join('%s %s / %s' % (side, fmt(d[side]['return_median']),
                                       fmt(d[side]['return_p95']))
                       for side, _ in sides),
             fmt(d['module']['swap_ms_median'], '%.0f'),
             fmt(d['module_defaults']['swap_ms_median'], '%.0f')))
    for x in [ngx, ngxd] + procs:
        x.terminate() if isinstance(x, subprocess.Popen) else x.stop()
    for srv in servers:
        srv.stop()
        shutil.rmtree(srv.slots, ignore_errors=True)
    return res


# 8. memory kinds and templates ------------------------------------------

def sse_data(r):
    """the data of each SSE event of a streamed reply, as it comes"""
    buf = b''
    while True:
        chunk = r.read1(65536)
        if not chunk:
            return
        buf += chunk
        while b'\n\n' in buf:
            event, buf = buf.split(b'\n\n', 1)
            for line in event.split(b'\n'):
                if line.startswith(b'data: ') and line != b'data: [DONE]':
                    yield line[6:]


def chat_turn(port, messages, sid, max_tokens, extra=None):
    """a streamed chat turn (extra: more of the body; else the byte tokens
    banned): (ttft, reply, cache_n, prompt tokens, completion tokens,
    headers)"""
    body = {'messages': messages, 'max_tokens': max_tokens, 'stream': True,
            'stream_options': {'include_usage': True}}
    body.update(extra if extra is not None
                else {'seed': 1, 'logit_bias': BAN})
    body = json.dumps(body).encode()
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=900)
    t0 = time.perf_counter()
    c.request('POST', '/v1/chat/completions', body,
              {'Content-Type': 'application/json', 'X-Session-Id': sid})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError('turn failed: %d %s' % (r.status, r.read()[:200]))
    ttft = None
    text = ''
    cache_n = prompt = completion = None
    for data in sse_data(r):
        d = json.loads(data)
        for ch in d.get('choices', []):
            delta = ch.get('delta') or {}
            piece = delta.get('content') or delta.get('reasoning_content')
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += delta.get('content') or ''
        if 'timings' in d:
            cache_n = d['timings'].get('cache_n')
            prompt = d['timings'].get('prompt_n', 0) + (cache_n or 0)
        if d.get('usage'):
            completion = d['usage'].get('completion_tokens')
    if ttft is None:
        ttft = time.perf_counter() - t0
    hdrs = dict(r.getheaders())
    c.close()
    return ttft, text, cache_n, prompt, completion, hdrs


def bench_models(work, quick):
    """per memory kind and template: two sessions on one slot taking turns,
    the returning turns through the module against llama-server alone at
    its defaults (RAM prompt cache) and with --cache-ram 0"""
    ptoks = 1536 if quick else 3072
    turns = 4 if quick else 8
    think = os.path.join(ROOT, 'rig', 'templates', 'chatml-think.jinja')
    tmpl = ['--jinja', '--chat-template-file', think]
    cases = [('llama', 'full', 'chatml', None, [], []),
             ('llama', 'full', 'think', None, tmpl, []),
             ('lfm2', 'hybrid', 'chatml', 'lfm2', [], []),
             ('lfm2', 'hybrid', 'think', 'lfm2', tmpl, []),
             ('gemma3', 'swa', 'chatml', 'gemma3', [], ['--swa-full']),
             ('gemma3', 'swa', 'think', 'gemma3', tmpl, ['--swa-full'])]
    ctx = ptoks * 2 + 2048
    out = []
    only = os.environ.get('BENCH_MODELS')     # e.g. "lfm2:chatml"
    for name, kind, template, gen, extra, module_only in cases:
        if only and '%s:%s' % (name, template) not in only.split(','):
            continue
        model = rig('make-model.sh', gen) if gen else None
        defaults = Llama(work, 'm-%s-%s-def' % (name, template), ctx,
                         args=[], model=model, extra=extra)
        noram = Llama(work, 'm-%s-%s-noram' % (name, template), ctx,
                      args=['--cache-ram', '0'], model=model, extra=extra)
        withmod = Llama(work, 'm-%s-%s-mod' % (name, template), ctx,
                        model=model, extra=extra + module_only)
        ngx, nport = module_nginx(work, 'nginx-m-%s-%s' % (name, template),
                                  withmod)
        sides = [('alone_defaults', defaults.port),
                 ('alone_cache_ram_0', noram.port), ('module', nport)]
        nwords = words_for(withmod.port, ptoks, 'mA')
        system = filler('sys', nwords // 4)
        conv = {}
        prev = {}
        rec = {s: {'ttft': [], 'reuse': [], 'cache_n': []} for s, _ in sides}
        for n in range(turns + 1):
            for sid in ('A', 'B'):
                for side, port in sides:
                    msgs = conv.setdefault((side, sid), [
                        {'role': 'system', 'content': system},
                        {'role': 'user', 'content':
                         filler(sid + 'h', nwords * 3 // 4) + ' Q1?'}])
                    if n:
                        msgs.append({'role': 'user', 'content':
                                     'Q%d? %s' % (n + 1, filler('q', 6))})
                    ttft, text, cache_n, prompt, completion, _ = chat_turn(
                        port, msgs, sid, 24)
                    msgs.append({'role': 'assistant', 'content': text})
                    if n:
                        # the history the turn shares with the previous one
                        shared = sum(prev[(side, sid)])
                        rec[side]['ttft'].append(ttft)
                        rec[side]['cache_n'].append(cache_n)
                        rec[side]['reuse'].append(
                            min(1.0, (cache_n or 0) / shared))
                        rec[side].setdefault('turns', []).append(
                            [n, sid, cache_n, prompt, shared])
                    prev[(side, sid)] = (prompt or 0, completion or 0)
                time.sleep(0.7)     # think time: the idle save runs
        row = {'model': name, 'memory': kind, 'template': template,
               'prompt_tokens': ptoks, 'returning_turns': 2 * turns,
               'module_flags': module_only, 'sides': {}}
        for side, _ in sides:
            r = rec[side]
            row['sides'][side] = {
                'ttft_median': median(sorted(r['ttft'])),
                'reuse_min': min(r['reuse']), 'reuse_median':
                    median(sorted(r['reuse'])),
                'cache_n_median': median(sorted(r['cache_n'])),
                'turns': r['turns']}
        d = row['sides']
        row['module_vs_defaults'] = (d['module']['ttft_median']
                                     / d['alone_defaults']['ttft_median'])
        print('models %-6s %-6s %-6s reuse min %.2f / %.2f / %.2f, ttft '
              'median %s / %s / %s s (alone defaults / cache-ram 0 / '
              'module), module %.2fx' % (
                  name, kind, template,
                  d['alone_defaults']['reuse_min'],
                  d['alone_cache_ram_0']['reuse_min'],
                  d['module']['reuse_min'],
                  fmt(d['alone_defaults']['ttft_median']),
                  fmt(d['alone_cache_ram_0']['ttft_median']),
                  fmt(d['module']['ttft_median']),
                  row['module_vs_defaults']))
        out.append(row)
        ngx.stop()
        for srv in (defaults, noram, withmod):
            srv.stop()
            shutil.rmtree(srv.slots, ignore_errors=True)
    return out


def bench_kvq(work, quick):
    """slot files and restores with the KV cache in f16 and in q8_0 (-ctk
    q8_0 -ctv q8_0 -fa on), the same session, side by side"""
    ptoks = 2048 if quick else 8192
    reps = 3 if quick else 7
    ctx = ptoks + 2048
    sides = [('f16', ['-fa', 'on']),
             ('q8_0', ['-fa', 'on', '-ctk', 'q8_0', '-ctv', 'q8_0'])]
    servers = {name: Llama(work, 'kvq-' + name, ctx, extra=flags)
               for name, flags in sides}
    nwords = words_for(servers['f16'].port, ptoks, 'kq')
    msgs = [{'role': 'system', 'content': filler('sys', nwords // 4)},
            {'role': 'user', 'content': filler('kqh', nwords * 3 // 4)}]
    res = {'prompt_tokens': ptoks, 'sides': {}}
    for name, _ in sides:
        srv = servers[name]
        chat_turn(srv.port, msgs, 'kv', 4)
        saves, restores = [], []
        size = None
        for _ in range(reps):
            st, _, p = post(srv.port, '/slots/0?action=save',
                            {'filename': 'kv.bin'})
            saves.append(json.loads(p)['timings']['save_ms'])
            size = os.path.getsize(os.path.join(srv.slots, 'kv.bin'))
            post(srv.port, '/slots/0?action=erase', {})
            st, _, p = post(srv.port, '/slots/0?action=restore',
                            {'filename': 'kv.bin'})
            restores.append(json.loads(p)['timings']['restore_ms'])
        res['sides'][name] = {'file_bytes': size,
                              'save_ms_median': median(sorted(saves)),
                              'restore_ms_median': median(sorted(restores))}
    d = res['sides']
    res['q8_0_vs_f16_bytes'] = d['q8_0']['file_bytes'] / d['f16']['file_bytes']
    res['q8_0_vs_f16_restore'] = (d['q8_0']['restore_ms_median']
                                  / d['f16']['restore_ms_median'])
    print('kvq %d tokens: file %d / %d bytes (f16 / q8_0, %.2fx), restore '
          '%.1f / %.1f ms (%.2fx), save %.1f / %.1f ms' % (
              ptoks, d['f16']['file_bytes'], d['q8_0']['file_bytes'],
              res['q8_0_vs_f16_bytes'], d['f16']['restore_ms_median'],
              d['q8_0']['restore_ms_median'], res['q8_0_vs_f16_restore'],
              d['f16']['save_ms_median'], d['q8_0']['save_ms_median']))
    for srv in servers.values():
        srv.stop()
        shutil.rmtree(srv.slots, ignore_errors=True)
    return res


# 11. a draft model: what a restore costs speculative decoding ------------

def draft_turn(port, msgs, n):
    """a greedy turn of n tokens: (reply, timings); /completion with the
    rendered prompt and no logit bias, as the draft samples without the
    target's bias (a banned token it proposes is never accepted)"""
    st, _, p = post(port, '/apply-template', {'messages': msgs})
    prompt = json.loads(p)['prompt']
    st, _, p = post(port, '/completion',
                    {'prompt': prompt, 'n_predict': n, 'temperature': 0,
                     'cache_prompt': True})
    j = json.loads(p)
    return j.get('content', ''), j.get('timings', {})


def bench_draft(work, quick):
    """the rig's model as its own draft (--spec-type draft-simple): the
    draft tokens accepted and the generation speed of a session's turns
    kept in its slot, after a restore of its file (erase, then restore: what
    the module does on a speculative slot), and after a full re-prefill;
    the same server, the same conversation"""
    ptoks = 1024 if quick else 4096
    gen = 32 if quick else 64
    reps = 2 if quick else 4
    model = rig('make-model.sh')
    srv = Llama(work, 'draft', ptoks * 2 + 1024,
                extra=['-md', model, '--spec-type', 'draft-simple'])
    nwords = words_for(srv.port, ptoks, 'dr')
    msgs = [{'role': 'system', 'content': filler('sys', nwords // 4)},
            {'role': 'user', 'content': filler('drh', nwords * 3 // 4)}]
    res = {'prompt_tokens': ptoks, 'generated': gen, 'sides': {}}

    def one(kind):
        # the conversation's next turn, the slot prepared as kind says
        if kind == 'restore':
            post(srv.port, '/slots/0?action=save', {'filename': 'd.bin'})
            post(srv.port, '/slots/0?action=erase', {})
            post(srv.port, '/slots/0?action=restore', {'filename': 'd.bin'})
        elif kind == 'reprefill':
            post(srv.port, '/slots/0?action=erase', {})
        reply, tm = draft_turn(srv.port, msgs, gen)
        msgs.extend([{'role': 'assistant', 'content': reply},
                     {'role': 'user', 'content': 'more %d' % len(msgs)}])
        return tm

    one('reprefill')
    for _ in range(reps):
        # 'after': the turn that follows a restore, kept in its slot
        for kind, how in (('kept', 'kept'), ('restore', 'restore'),
                          ('after', 'kept'), ('reprefill', 'reprefill')):
            res['sides'].setdefault(kind, []).append(one(how))
    summary = {}
    for kind, tms in res['sides'].items():
        drafted = sum(t.get('draft_n', 0) for t in tms)
        accepted = sum(t.get('draft_n_accepted', 0) for t in tms)
        summary[kind] = {
            'draft_n': drafted, 'draft_accepted': accepted,
            'prompt_ms_median': median([t.get('prompt_ms', 0) for t in tms]),
            'predicted_per_second_median':
                median([t.get('predicted_per_second', 0) for t in tms]),
            'cache_n_median': median([t.get('cache_n', 0) for t in tms])}
    res['summary'] = summary
    for kind in ('kept', 'restore', 'after', 'reprefill'):
        d = summary.get(kind)
        if d:
            print('draft %-9s accepted %4d of %4d drafted, prompt %.0f ms '
                  '(cache_n %d), generation %.1f tokens/s' % (
                      kind, d['draft_accepted'], d['draft_n'],
                      d['prompt_ms_median'], d['cache_n_median'],
                      d['predicted_per_second_median']))
    srv.stop()
    shutil.rmtree(srv.slots, ignore_errors=True)
    return res


# 12. the returning turn, the zone's defaults against llama-server's ------

def module_zone(work, name, llama, nslots, zone_extra=''):
    """nginx + module, the zone as the README's example has it (a keepalive
    upstream) plus zone_extra: (the Nginx, its port)"""
    nport = free_port()
    ngx = Nginx(work, name, '''
    llama_session_zone zone=llama:4m slots=%d store=%s %s;
    upstream llama { server 127.0.0.1:%d; keepalive 8; keepalive_timeout 4s; }
    server {
        listen 127.0.0.1:%d;
        location / {
            llama_session llama;
            llama_session_wait_timeout 600s;
            proxy_pass http://llama;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream error timeout non_idempotent;
            proxy_buffering off;
            proxy_read_timeout 900s;
            add_header X-S-Action $llama_session_action always;
            add_header X-S-Wait $llama_session_wait_ms always;
            add_header X-S-Swap $llama_session_swap_ms always;
        }
        location /_llama_slots/ {
            internal;
            proxy_pass http://llama/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream error timeout non_idempotent;
            proxy_read_timeout 900s;
        }
    }''' % (nslots, llama.slots, zone_extra, llama.port, nport))
    wait_http(nport)
    return ngx, nport


def drive_clients(sides, turn, nconv, rounds):
    """many clients, side after side: every conversation's first turn (not
    measured), then all at once, each returning after a think time of 0.5
    to 4 s (the same seeded times for each side), so that returning turns
    meet each other, not first prefills"""
    import random
    import threading
    for side, port in sides:
        rng = random.Random(7)
        thinks = {i: [rng.uniform(0.5, 4.0) for _ in range(rounds)]
                  for i in range(nconv)}

        def first(i):
            turn(side, port, i, 0)

        def client(i):
            for rnd in range(1, rounds + 1):
                time.sleep(thinks[i][rnd - 1])
                turn(side, port, i, rnd)

        for fn in (first, client):
            th = [threading.Thread(target=fn, args=(i,))
                  for i in range(nconv)]
            for x in th:
                x.start()
            for x in th:
                x.join()


def returning_turns(sides, conv, prefix):
    """(times to first token, [cached, prompt] tokens, turn): turn(side,
    port, i, rnd) sends conversation i's next turn (rnd 0: its first) as
    session prefix-i and records its returning turns by side"""
    import threading
    rec = {side: [] for side, _ in sides}
    cached = {side: [0, 0] for side, _ in sides}
    lock = threading.Lock()

    def turn(side, port, i, rnd):
        msgs = conv[(side, i)]
        if rnd:
            msgs.append({'role': 'user', 'content':
                         'Q%d? %s' % (rnd + 1, filler('q', 8))})
        ttft, text, cache_n, hdrs, prompt_n = stream_turn(
            port, msgs, '%s-%d' % (prefix, i))
        msgs.append({'role': 'assistant', 'content': text})
        if rnd:
            with lock:
                rec[side].append(ttft)
                cached[side][0] += cache_n or 0
                cached[side][1] += prompt_n or 0
                if os.environ.get('BENCH_DEBUG'):
                    h = {k.lower(): v for k, v in hdrs.items()}
                    print('  %s %s-%d round %d: %.3f s, %s, wait %s ms, '
                          'swap %s ms, %s cached of %s' % (
                              side, prefix, i, rnd, ttft,
                              h.get('x-s-action', '-'),
                              h.get('x-s-wait', '-'), h.get('x-s-swap', '-'),
                              cache_n, prompt_n))

    return rec, cached, turn


def returning_row(sides, rec, row, cached=None):
    """p50 / p95 of each side, and each against llama-server alone (the
    first side); row['line'] says it in one line"""
    row['sides'] = {}
    for side, _ in sides:
        row['sides'][side] = {'p50': median(rec[side]),
                              'p95': p95(rec[side]),
                              'samples': len(rec[side]),
                              'ttft': sorted(round(x, 3) for x in rec[side])}
        if cached is not None:
            c, n = cached[side]
            row['sides'][side]['cached_share'] = c / n if n else 0
    first = sides[0][0]
    d = row['sides']
    line = '%s %s / %s' % (first, fmt(d[first]['p50']), fmt(d[first]['p95']))
    for side, _ in sides[1:]:
        row[side + '_vs_alone_p50'] = d[side]['p50'] / d[first]['p50']
        row[side + '_vs_alone_p95'] = d[side]['p95'] / d[first]['p95']
        line += ', %s %s / %s (%.2fx / %.2fx)' % (
            side, fmt(d[side]['p50']), fmt(d[side]['p95']),
            row[side + '_vs_alone_p50'], row[side + '_vs_alone_p95'])
    if cached is not None:
        line += '; cached: ' + ', '.join(
            '%s %.1f %%' % (side, 100 * d[side]['cached_share'])
            for side, _ in sides)
    row['line'] = line
    return row


def bench_returning(work, quick):
    """returning turns' time to first token: llama-server alone at its
    defaults (its RAM prompt cache), the module's zone at its defaults (no
    save_idle: each swap saves on the client's path) and with save_idle=1s;
    one slot with one client (two sessions taking turns, a think time
    between turns), of 2k tokens and of pi's 660, and four slots with
    twelve clients at once (each its own conversation of 2k tokens, think
    times of 0.5 to 4 s)"""
    big = 1024 if quick else 2048
    res = {'prompt_tokens': big}

    for nslots, nclients, ptoks in [
            x for x in ((1, 1, big), (1, 1, 660), (4, 12, big))
            if str(x[0]) in os.environ.get('BENCH_SLOTS', '1,4')]:
        ctx = nslots * (ptoks * 2 + 2048)
        rounds = (2 if quick else 4) if nslots > 1 else (4 if quick else 8)
        rounds = int(os.environ.get('BENCH_RET_ROUNDS', rounds))
        alone = Llama(work, 'ret-alone-%d' % nslots, ctx, args=[], np=nslots)
        more = os.environ.get('BENCH_MODULE_EXTRA', '').split()
        mod = Llama(work, 'ret-mod-%d' % nslots, ctx, np=nslots, extra=more)
        modi = Llama(work, 'ret-modi-%d' % nslots, ctx, np=nslots,
                     extra=more)
        ngx, nport = module_zone(work, 'nginx-ret-%d' % nslots, mod, nslots)
        ngxi, nporti = module_zone(work, 'nginx-reti-%d' % nslots, modi,
                                   nslots, 'save_idle=1s')
        # the two tiers: llama-server's RAM cache at its default budget
        modr = Llama(work, 'ret-modr-%d' % nslots, ctx, np=nslots,
                     extra=more, ram=8192)
        ngxr, nportr = module_zone(work, 'nginx-retr-%d' % nslots, modr,
                                   nslots, os.environ.get('BENCH_RAM_ZONE',
                                                          'ram=8g save_idle=1s'))
        sides = [('alone_defaults', alone.port), ('zone_defaults', nport),
                 ('zone_save_idle', nporti), ('zone_ram', nportr)]
        if os.environ.get('BENCH_RET_SIDES'):
            # e.g. "zone_ram": llama-server alone and those (the others'
            # figures are left out)
            keep = os.environ['BENCH_RET_SIDES'].split(',')
            sides = [x for x in sides
                     if x[0] == 'alone_defaults' or x[0] in keep]
        nwords = words_for(alone.port, ptoks, 'ret')
        system = filler('sys', nwords // 4)
        nconv = 2 if nslots == 1 else nclients
        conv = {(side, i): [{'role': 'system', 'content': system},
                            {'role': 'user', 'content':
                             filler('r%dw' % i, nwords * 3 // 4) + ' Q1?'}]
                for side, _ in sides for i in range(nconv)}
        rec, cached, turn = returning_turns(sides, conv, 'ret')

        if nslots == 1:
            # one client: the sides alternate turn by turn, two sessions
            # take turns, a think time of 1.5 s between a client's turns
            for rnd in range(rounds):
                for i in range(nconv):
                    for side, port in sides:
                        turn(side, port, i, rnd)
                    time.sleep(1.5)
        else:
            drive_clients(sides, turn, nconv, rounds)

        row = returning_row(sides, rec, {'slots': nslots,
                                         'clients': nclients}, cached)
        line = row.pop('line')
        res['%d_slots' % nslots
            + ('' if ptoks == big else '_%d_tokens' % ptoks)] = row
        print('returning %d tokens, %d slot(s), %2d client(s): p50 / p95 (s) '
              '%s' % (ptoks, nslots, nclients, line))
        for x in (ngx, ngxi, ngxr):
            x.stop()
        for srv in (alone, mod, modi, modr):
            srv.stop()
            shutil.rmtree(srv.slots, ignore_errors=True)
    return res


def bench_budget(work, quick):
    """twenty-four conversations on four slots, llama-server's RAM cache
    sized to hold eight of them on both sides (the same --cache-ram):
    llama-server alone at its defaults otherwise, against the module's two
    tiers (ram= that size, save_idle=1s), whose conversations that RAM does
    not hold come back from their files; returning turns' time to first
    token and the share of their prompt tokens cached"""
    ptoks = 1024 if quick else 2048
    nslots, nconv, hold = 4, 24, 8
    rounds = int(os.environ.get('BENCH_BUDGET_ROUNDS', 2 if quick else 3))
    ctx = nslots * (ptoks * 2 + 2048)

    # a conversation's bytes in RAM: what a save of one slot writes, per
    # token, times its tokens at its last turn (each turn adds ~40)
    probe = Llama(work, 'budget-probe', ptoks * 2 + 2048)
    nwords = words_for(probe.port, ptoks, 'bud')
    system = filler('sys', nwords // 4)
    stream_turn(probe.port, [{'role': 'system', 'content': system},
                             {'role': 'user', 'content':
                              filler('b0w', nwords * 3 // 4) + ' Q1?'}],
                'probe')
    st, _, payload = post(probe.port, '/slots/0?action=save',
                          {'filename': 'probe.bin'})
    saved = json.loads(payload)
    per_token = saved['n_written'] / saved['n_saved']
    probe.stop()
    shutil.rmtree(probe.slots, ignore_errors=True)
    mib = int(hold * (ptoks + 40 * (rounds + 1)) * per_token
              / (1024 * 1024)) + 1

    alone = Llama(work, 'budget-alone', ctx, np=nslots, cache_ram=mib)
    modr = Llama(work, 'budget-modr', ctx, np=nslots, ram=mib)
    ngxr, nportr = module_zone(work, 'nginx-budget', modr, nslots,
                               'ram=%dm save_idle=1s' % mib)
    sides = [('alone_defaults', alone.port), ('zone_ram', nportr)]
    conv = {(side, i): [{'role': 'system', 'content': system},
                        {'role': 'user', 'content':
                         filler('b%dw' % i, nwords * 3 // 4) + ' Q1?'}]
            for side, _ in sides for i in range(nconv)}
    rec, cached, turn = returning_turns(sides, conv, 'bud')

    drive_clients(sides, turn, nconv, rounds)

    row = returning_row(sides, rec, {'slots': nslots, 'conversations': nconv,
                                     'cache_ram_mib': mib,
                                     'bytes_per_token': per_token}, cached)
    print('returning %d tokens, %d slots, %d conversations, --cache-ram %d '
          '(about %d of them): p50 / p95 (s) %s' % (
              ptoks, nslots, nconv, mib, hold, row.pop('line')))
    ngxr.stop()
    for srv in (alone, modr):
        srv.stop()
        shutil.rmtree(srv.slots, ignore_errors=True)
    return row


# 13. a fleet: sticky owners against routing by load ---------------------

def fleet_nginx(work, name, llamas, store, zone_extra, balance, ports,
                edges=0):
    """owner zones (one per llama-server, store(i) their folders, on
    ports[i]: the hash's ring is that of the servers' addresses) and a
    front upstream (balance) on one nginx: (the Nginx, the front's port);
    with edges, the front is that many edge nginx instances instead, as
    on other hosts: ([the owners' Nginx and the edges'], [their ports])"""
    conf, servers = '', ''
    for i, ll in enumerate(llamas):
        port = ports[i]
        conf += '''
    llama_session_zone zone=o%d:4m store=%s%s;
    server {
        listen 127.0.0.1:%d;
        location / {
            llama_session o%d;
            llama_session_wait_timeout 600s;
            proxy_pass http://127.0.0.1:%d;
            proxy_buffering off;
            proxy_read_timeout 900s;
            add_header X-S-Action $llama_session_action always;
            add_header X-Backend o%d always;
        }
        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%d/;
            proxy_read_timeout 900s;
        }
    }''' % (i, store(i), zone_extra, port, i, ll.port, i, ll.port)
        servers += '        server 127.0.0.1:%d;\n' % port
    front = '''
    upstream owners {
        zone owners 64k;
        %s;
%s    }
    server {
        listen 127.0.0.1:%d;
        location / {
            llama_session identity;
            proxy_pass http://owners;
            proxy_buffering off;
            proxy_read_timeout 900s;
        }
    }'''
    if edges:
        ngx = [Nginx(work, name, conf)]
        fports = [free_port() for _ in range(edges)]
        for i, fport in enumerate(fports):
            ngx.append(Nginx(work, '%s-edge%d' % (name, i),
                             front % (balance, servers, fport)))
        for port in ports + fports:
            wait_http(port)
        return ngx, fports
    fport = free_port()
    ngx = Nginx(work, name, conf + front % (balance, servers, fport))
    wait_http(fport)
    return ngx, fport


def bench_fleet(work, quick):
    """three llama-servers of one model, an owner zone each, a front: the
    sticky hash of docs/scaling.md with a folder per owner, the same with
    one shared folder (shared=on), and least_conn with the shared folder.
    Sessions of unequal size (three long, nine short), twelve clients at
    once with think times; each returning turn's time to first token, what
    it was (hit, restore, fresh), and the spread of the work over the
    owners: the prompt tokens each one held and prefilled"""
    import random
    import threading
    nback = 3
    rounds = 3 if quick else 6
    big, small = (1536, 256) if quick else (3072, 384)
    sizes = [big] * 3 + [small] * 9
    res = {'backends': nback, 'sessions': len(sizes), 'rounds': rounds,
           'tokens': {'long': big, 'short': small}}
    sides = [('hash_own_folders', 'hash $llama_session_key consistent', 0),
             ('hash_shared', 'hash $llama_session_key consistent', 1),
             ('least_conn_shared', 'least_conn', 1)]
    ctx = 2 * (big * 2 + 1024)
    # the same owners' addresses on every side: the same ring for the hash
    ports = [free_port() for _ in range(nback)]
    for side, balance, shared in sides:
        folder = os.path.join(work, 'fleet-%s' % side)
        llamas = [Llama(work, 'fleet-%s-%d' % (side, i), ctx, np=2,
                        slots=(folder if shared else None))
                  for i in range(nback)]
        if shared:
            os.makedirs(folder, exist_ok=True)
        ngx, port = fleet_nginx(
            work, 'nginx-fleet-%s' % side, llamas,
            (lambda i: folder) if shared else (lambda i: llamas[i].slots),
            ' slots=2 save_idle=300ms' + (' shared=on' if shared else ''),
            balance, ports)
        nwords = {n: words_for(llamas[0].port, n, 'fl') for n in set(sizes)}
        conv = {}
        for i, n in enumerate(sizes):
            conv[i] = [{'role': 'system', 'content': filler('sys', 200)},
                       {'role': 'user', 'content':
                        filler('f%dw' % i, nwords[n]) + ' Q1?'}]
        rec, kinds, held, fill, lock = [], {}, {}, {}, threading.Lock()

        def turn(i, rnd):
            msgs = conv[i]
            if rnd:
                msgs.append({'role': 'user', 'content':
                             'Q%d? %s' % (rnd + 1, filler('q', 8))})
            ttft, text, cache_n, prompt, _, hdrs = chat_turn(
                port, msgs, 'fleet-%d' % i, 4, {'temperature': 0})
            msgs.append({'role': 'assistant', 'content': text})
            h = {k.lower(): v for k, v in hdrs.items()}
            b = h.get('x-backend', '?')
            with lock:
                held[b] = held.get(b, 0) + prompt
                fill[b] = fill.get(b, 0) + prompt - (cache_n or 0)
                if rnd:
                    rec.append(ttft)
                    k = h.get('x-s-action', '?')
                    kinds[k] = kinds.get(k, 0) + 1

        rng = random.Random(11)
        thinks = {i: [rng.uniform(0.5, 3.0) for _ in range(rounds)]
                  for i in conv}

        def client(i):
            turn(i, 0)
            for rnd in range(1, rounds + 1):
                time.sleep(thinks[i][rnd - 1])
                turn(i, rnd)

        th = [threading.Thread(target=client, args=(i,)) for i in conv]
        for x in th:
            x.start()
        for x in th:
            x.join()
        def spread(d):
            v = [d.get('o%d' % i, 0) for i in range(nback)]
            return max(v) / (sum(v) / float(nback)) if sum(v) else None

        res[side] = {'p50': median(rec), 'p95': p95(rec),
                     'samples': len(rec), 'kinds': kinds,
                     'held': held, 'prefilled': fill,
                     'held_max_over_mean': spread(held),
                     'prefilled_max_over_mean': spread(fill)}
        print('fleet %-18s returning p50 / p95 %s / %s s, %s; tokens held '
              'per owner %s (max/mean %.2f), prefilled %s (max/mean %.2f)'
              % (side, fmt(res[side]['p50']), fmt(res[side]['p95']),
                 ', '.join('%s %d' % kv for kv in sorted(kinds.items())),
                 '/'.join(str(held.get('o%d' % i, 0))
                          for i in range(nback)),
                 res[side]['held_max_over_mean'],
                 '/'.join(str(fill.get('o%d' % i, 0))
                          for i in range(nback)),
                 res[side]['prefilled_max_over_mean'] or 0))
        ngx.stop()
        for ll in llamas:
            ll.stop()
        shutil.rmtree(folder, ignore_errors=True)
    for side, _, _ in sides[1:]:
        res[side + '_vs_own_p50'] = res[side]['p50'] / res['hash_own_folders']['p50']
        res[side + '_vs_own_p95'] = res[side]['p95'] / res['hash_own_folders']['p95']
    return res


# 6. a team on four slots ------------------------------------------------

def bench_team(work, quick, full=False):
    import threading
    nslots, clients, think, rounds = 4, 4, 1.0, 3
    grid = [(4096, [4, 8, 16])]
    if full:
        grid = [(4096, [4, 8, 16]), (8192, [4, 8, 16])]
    if quick:
        grid = [(2048, [4, 8])]
    kv_per_token = 8.3 * 1024
    results = []

    for ptoks, ms in grid:
        # room for the prompt's own words (each session's filler tokenizes
        # longer than the calibration's) and three turns
        ctx = nslots * (ptoks * 3 // 2 + 2048)
        for m in ms:
            budget = int(2.5 * ptoks * kv_per_token / 2 ** 20) + 8
            defaults = Llama(work, 'team-defaults-%d-%d' % (ptoks, m), ctx,
                             args=[], np=nslots)
            ram2 = Llama(work, 'team-ram2-%d-%d' % (ptoks, m), ctx,
                         args=['--cache-ram', str(budget)], np=nslots)
            withmod = Llama(work, 'team-module-%d-%d' % (ptoks, m), ctx,
                            np=nslots)
            ngx, nport = module_zone(work, 'nginx-team-%d-%d' % (ptoks, m),
                                     withmod, nslots,
                                     'save_idle=500ms backend=127.0.0.1:%d'
                                     % withmod.port)
            sides = [('defaults', defaults.port), ('ram_two_sessions',
                                                   ram2.port),
                     ('module', nport)]
            # the words for a session of about ptoks tokens, measured once
            nwords = words_for(withmod.port, ptoks, 'team')
            system = filler('sys', nwords // 4)
            row = {'prompt_tokens': ptoks, 'sessions': m, 'slots': nslots,
                   'clients': clients, 'think_seconds': think, 'sides': {}}

            for side, port in sides:
                conv = {i: [{'role': 'system', 'content': system},
                            {'role': 'user', 'content':
                             filler('u%dw' % i, nwords * 3 // 4) + ' Q1?'}]
                        for i in range(m)}
                lock = threading.Lock()
                rec = {'return': [], 'cached': 0, 'prompt': 0, 'turns': 0}

                def client(k, round_no):
                    for i in range(k, m, clients):
                        msgs = conv[i]
                        if round_no:
                            msgs.append({'role': 'user', 'content':
                                         'Q%d? %s' % (round_no + 1,
                                                      filler('q', 8))})
                        ttft, text, cache_n, _, prompt_n = stream_turn(
                            port, msgs, 'team-%d' % i)
                        msgs.append({'role': 'assistant', 'content': text})
                        with lock:
                            rec['turns'] += 1
                            if round_no:
                                rec['return'].append(ttft)
                                rec['cached'] += cache_n or 0
                                rec['prompt'] += prompt_n or 0
                        time.sleep(think)

                t0 = time.time()
                for round_no in range(rounds):
                    th = [threading.Thread(target=client, args=(k, round_no))
                          for k in range(clients)]
                    for x in th:
                        x.start()
                    for x in th:
                        x.join()
                elapsed = time.time() - t0
                row['sides'][side] = {
                    'return_p50': median(rec['return']),
                    'return_p95': p95(rec['return']),
                    'turns_per_minute': 60.0 * rec['turns'] / elapsed,
                    'cached_share': (rec['cached'] / rec['prompt']
                                     if rec['prompt'] else None),
                    'samples': len(rec['return']),
                    'seconds': round(elapsed, 1),
                }
            d = row['sides']
            row['module_vs_ram_two'] = (d['module']['return_p50']
                                        / d['ram_two_sessions']['return_p50'])
            row['module_vs_defaults'] = (d['module']['return_p50']
                                         / d['defaults']['return_p50'])
            results.append(row)
            print('team %d tokens, %2d sessions on %d slots: returning p50 '
                  '%s / %s / %s s (defaults / RAM for two / module), '
                  'turns/min %.1f / %.1f / %.1f, cached %s / %s / %s'
                  % (ptoks, m, nslots, fmt(d['defaults']['return_p50']),
                     fmt(d['ram_two_sessions']['return_p50']),
                     fmt(d['module']['return_p50']),
                     d['defaults']['turns_per_minute'],
                     d['ram_two_sessions']['turns_per_minute'],
                     d['module']['turns_per_minute'],
                     fmt(d['defaults']['cached_share'], '%.2f'),
                     fmt(d['ram_two_sessions']['cached_share'], '%.2f'),
                     fmt(d['module']['cached_share'], '%.2f')))

            ngx.stop()
            for srv in (defaults, ram2, withmod):
                srv.stop()
                shutil.rmtree(srv.slots, ignore_errors=True)

    return results


# 10. the agent CLIs' own requests -------------------------------------------

def recorded(name):
    """the POST requests of a recording in t/data"""
    with open(os.path.join(ROOT, 't', 'data', name)) as f:
        return [r for r in map(json.loads, filter(str.strip, f))
                if r['method'] == 'POST']


def replay_turn(port, path, headers, body):
    """a streamed request as the client sent it: (ttft, cached tokens)"""
    h = {k: v for k, v in headers.items()
         if k not in ('host', 'content-length', 'connection',
                      'accept-encoding')}
    data = json.dumps(body).encode()
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=900)
    t0 = time.perf_counter()
    c.request('POST', path, data, h)
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError('replay failed: %d %s' % (r.status, r.read()[:300]))
    ttft = None
    cached = None
    text = []
    for data in sse_data(r):
        if ttft is None and b'delta' in data:
            ttft = time.perf_counter() - t0
        d = json.loads(data)
        for ch in d.get('choices') or []:
            text.append((ch.get('delta') or {}).get('content') or '')
        u = d.get('usage') or (d.get('response') or {}).get('usage') or {}
        if 'cache_read_input_tokens' in u:
            cached = u['cache_read_input_tokens']
        elif 'input_tokens_details' in u:
            cached = u['input_tokens_details'].get('cached_tokens')
        elif 'prompt_tokens_details' in u:
            cached = u['prompt_tokens_details'].get('cached_tokens')
        if 'timings' in d and cached is None:
            cached = d['timings'].get('cache_n')
    c.close()
    return ((ttft if ttft is not None else time.perf_counter() - t0), cached,
            ''.join(text))


def client_convs():
    """per client, a maker of its conversations: conv(n) gives the first
    request (path, headers, body) of conversation n (0: the recorded one,
    1: the recorded second one, else the second one made another's), and
    more(request, i) its next turn (the reply "Hi." and a new question)"""

    def small(body, key):
        body = json.loads(json.dumps(body))
        body[key] = 4
        body['temperature'] = 0
        return body

    out = {}

    # Claude Code: another conversation has its session id, its first
    # prompt, and the cc_version suffix Claude Code derives from it
    cc_a, cc_b, _ = recorded('claude-code-exchange.jsonl')

    def cc(n):
        req = cc_a if n == 0 else cc_b
        h = dict(req['headers'])
        body = small(req['body'], 'max_tokens')
        if n > 1:
            sid = 'conversation-%d' % n
            h['x-claude-code-session-id'] = sid
            body['messages'][0]['content'][-1]['text'] = 'say ' + sid
            head = body['system'][0]['text']
            v = head.index(';', head.index('cc_version=')) - 3
            body['system'][0]['text'] = (
                head[:v] + hashlib.sha256(sid.encode()).hexdigest()[:3]
                + head[v + 3:])
        return (req['path'], h, body)

    def cc_more(req, i):
        body = json.loads(json.dumps(req[2]))
        body['messages'] += [
            {'role': 'assistant', 'content': [{'type': 'text', 'text': 'Hi.'}]},
            {'role': 'user', 'content': [{'type': 'text',
                                          'text': 'and more, %d' % i}]}]
        return (req[0], req[1], body)

    out['claude-code'] = (cc, cc_more)

    # Codex: another conversation has its thread id (session-id, thread-id,
    # x-client-request-id, prompt_cache_key) and its first prompt
    cx_a, cx_b, cx_a2 = recorded('codex-exchange.jsonl')
    reply = cx_a2['body']['input'][len(cx_a['body']['input'])]

    def cx(n):
        req = cx_a if n == 0 else cx_b
        h = dict(req['headers'])
        body = small(req['body'], 'max_output_tokens')
        if n > 1:
            sid = 'conversation-%d' % n
            for k in ('session-id', 'thread-id', 'x-client-request-id'):
                h[k] = sid
            body['prompt_cache_key'] = sid
            body['input'][-1]['content'][0]['text'] = 'say ' + sid
        return ('/v1/responses', h, body)

    def cx_more(req, i):
        body = json.loads(json.dumps(req[2]))
        body['input'] += [json.loads(json.dumps(reply)),
                          {'type': 'message', 'role': 'user', 'content': [
                              {'type': 'input_text',
                               'text': 'and more, %d' % i}]}]
        return (req[0], req[1], body)

    out['codex'] = (cx, cx_more)

    # a chat client (opencode's shape: x-session-id, system + tools):
    # Codex's prompt as a chat completion
    dev = [i for i in cx_a['body']['input'] if i.get('role') == 'developer']
    system = '\n\n'.join(p['text'] for i in dev for p in i['content'])
    tools = [{'type': 'function', 'function': {
                 'name': t['name'], 'description': t.get('description', ''),
                 'parameters': t.get('parameters', {})}}
             for t in cx_a['body'].get('tools', [])
             if t.get('type') == 'function']

    def chat(n):
        sid = 'chat-%d' % n
        return ('/v1/chat/completions',
                {'content-type': 'application/json', 'x-session-id': sid},
                {'messages': [{'role': 'system', 'content': system},
                              {'role': 'user', 'content': 'say ' + sid}],
                 'tools': tools, 'max_tokens': 4, 'temperature': 0,
                 'stream': True, 'logit_bias': BAN})

    def chat_more(req, i):
        body = json.loads(json.dumps(req[2]))
        body['messages'] += [{'role': 'assistant', 'content': 'Hi.'},
                             {'role': 'user', 'content': 'and more, %d' % i}]
        return (req[0], req[1], body)

    out['chat'] = (chat, chat_more)

    # Qwen Code (no id at all): every conversation's first user message is
    # the same but for its last part, the prompt; each turn moves the date
    # reminder from the previous last user message to the new one, and
    # echoes the reply it got
    qw = recorded('qwen-code-exchange.jsonl')
    qw_a, qw_b = qw[0], qw[2]

    # (the rig's random model says the same words to every prompt: a
    # length of its own per conversation gives each its own replies, as a
    # real model's words do, which Qwen Code's turns are known by)
    def first_turns(first, second, key):
        """conversation n of a client without an id: its own prompt, the
        last text part of its first user message"""
        def conv(n):
            req = first if n == 0 else second
            body = small(req['body'], key)
            body[key] = 3 + n
            if n > 1:
                body['messages'][1]['content'][-1]['text'] = (
                    'say conversation-%d' % n)
            return (req['path'], dict(req['headers']), body)
        return conv

    qwen = first_turns(qw_a, qw_b, 'max_tokens')

    def qwen_more(req, i, reply='Hi.'):
        body = json.loads(json.dumps(req[2]))
        last = body['messages'][-1]['content']
        reminder = [p for p in last if 'The current date is' in
                    p.get('text', '')]
        body['messages'][-1]['content'] = [
            p for p in last if p not in reminder]
        body['messages'] += [
            {'role': 'assistant', 'content': reply},
            {'role': 'user', 'content': reminder + [
                {'type': 'text', 'text': 'and more, %d' % i}]}]
        return (req[0], req[1], body)

    out['qwen-code'] = (qwen, qwen_more)

    # pi (no id by default): its turns extend the previous ones
    pi = recorded('pi-exchange.jsonl')
    pi_a, pi_b = pi[0], pi[1]

    pi_conv = first_turns(pi_a, pi_b, 'max_completion_tokens')

    def pi_more(req, i, reply='Hi.'):
        body = json.loads(json.dumps(req[2]))
        body['messages'] += [
            {'role': 'assistant', 'content': reply},
            {'role': 'user', 'content': [{'type': 'text',
                                          'text': 'and more, %d' % i}]}]
        return (req[0], req[1], body)

    out['pi'] = (pi_conv, pi_more)
    return out


# who speaks, in turn: a new conversation, or a returning one
CLIENT_SCHEDULE = [0, 1, 0, 1, 2, 0, 3, 1, 2, 4, 0, 3, 1, 2, 4, 0]


def bench_clients(work, quick):
    results = []

    only = os.environ.get('BENCH_CLIENTS')     # e.g. "codex"
    for client, (conv, more) in client_convs().items():
        if only and client not in only.split(','):
            continue

        # the module as it ships (warm starts cut to the system prompt),
        # and with "history" (a new conversation starts from the slot as it
        # is when it holds one of the same system prompt, as llama-server
        # alone does: for a namespace whose users may see each other's)
        defaults = Llama(work, 'clients-defaults-' + client, 32768, args=[])
        withmod = Llama(work, 'clients-module-' + client, 32768)
        ngx, nport = module_nginx(work, 'nginx-clients-' + client, withmod,
                                  'llama_session_warm system;')
        withhist = Llama(work, 'clients-history-' + client, 32768)
        ngh, hport = module_nginx(work, 'nginx-clients-h-' + client,
                                  withhist, 'llama_session_warm history;')
        sides = [('defaults', defaults.port), ('module', nport),
                 ('module_history', hport)]
        rec = {side: [] for side, _ in sides}
        last = {}
        said = {}
        kinds = []

        for i, n in enumerate(CLIENT_SCHEDULE):
            kind = ('returning' if (n, sides[0][0]) in last
                    else 'first' if n == 0 else 'new')
            kinds.append(kind)
            for side, port in sides:
                # each side's conversation goes on from the reply it got
                if kind == 'returning':
                    req = (more(last[n, side], i, said[n, side])
                           if client in ('qwen-code', 'pi')
                           else more(last[n, side], i))
                else:
                    req = conv(n)
                last[n, side] = req
                ttft, cached, said[n, side] = replay_turn(port, *req)
                rec[side].append({'ttft': ttft, 'cached': cached})
                if os.environ.get('BENCH_DEBUG'):
                    print('  %s %s %s %d: %.3f s, %s cached'
                          % (client, side, kind, n, ttft, cached))
            # a user's pause between turns: the idle saves happen there
            time.sleep(0.6)

        row = {'client': client, 'schedule': CLIENT_SCHEDULE,
               'kinds': kinds, 'sides': rec}
        for kind in ('first', 'new', 'returning'):
            at = [i for i, k in enumerate(kinds) if k == kind]
            for side, _ in sides:
                row['%s_%s_median' % (kind, side)] = median(
                    [rec[side][i]['ttft'] for i in at])
                row['%s_%s_cached_min' % (kind, side)] = min(
                    [rec[side][i]['cached'] or 0 for i in at])
            for side in ('module', 'module_history'):
                row['%s_%s_vs_defaults' % (kind, side)] = (
                    row['%s_%s_median' % (kind, side)]
                    / row['%s_defaults_median' % kind])
        results.append(row)
        for kind in ('first', 'new', 'returning'):
            print('clients %-11s %-9s %s / %s / %s s (defaults / module / '
                  'history), %.2fx / %.2fx; cached min %s / %s / %s'
                  % (client, kind, fmt(row[kind + '_defaults_median']),
                     fmt(row[kind + '_module_median']),
                     fmt(row[kind + '_module_history_median']),
                     row[kind + '_module_vs_defaults'],
                     row[kind + '_module_history_vs_defaults'],
                     row[kind + '_defaults_cached_min'],
                     row[kind + '_module_cached_min'],
                     row[kind + '_module_history_cached_min']))

        ngx.stop()
        ngh.stop()
        for srv in (defaults, withmod, withhist):
            srv.stop()
            shutil.rmtree(srv.slots, ignore_errors=True)

    return results


# 14. balance: where a session's state is and how loaded each owner is -------

def balance_key(sid, system, first):
    """the module's session key of a chat whose messages start with this
    system prompt and first user message (body.c; t/lib LlamaTest's
    session_key)"""
    inp = b'\0\0' + sid.encode()
    inp += b'\0s' + hashlib.sha256(system.encode()).digest()[:8]
    head = json.dumps('user').encode() + b'\0' + first.encode()[:256]
    inp += b'\0h' + hashlib.sha256(head).digest()[:8]
    safe = ''.join(c if c.isalnum() or c in '_-' else '_' for c in sid[:32])
    return safe + '-' + hashlib.sha256(inp).hexdigest()[:24]


def balance_ring(ports):
    """nginx's "hash ... consistent" ring over 127.0.0.1:port servers, 160
    points each: sorted (hash, server index)"""
    import zlib
    ring = []
    for i, port in enumerate(ports):
        base = zlib.crc32(('127.0.0.1\0%d' % port).encode())
        prev = 0
        for _ in range(160):
            h = zlib.crc32(prev.to_bytes(4, 'little'), base)
            ring.append((h, i))
            prev = h
    ring.sort()
    return ring


def balance_home(ring, key):
    import bisect
    import zlib
    k = bisect.bisect_left(ring, (zlib.crc32(key.encode()), -1))
    return ring[k % len(ring)][1]


def slow_store(root, mnt, rate):
    """root's files at mnt, the slot files (*.bin) carried at rate bytes a
    second, one at a time (t/hangfs.py --rate: a store at the end of a
    link, or one whose files are as large as a real model's); returns the
    pass-through's process"""
    os.makedirs(root, exist_ok=True)
    os.makedirs(mnt, exist_ok=True)
    p = subprocess.Popen(['/usr/bin/python3',
                          os.path.join(ROOT, 't', 'hangfs.py'),
                          '--rate=%d' % rate, root, mnt,
                          os.path.join(root + '.no-hold'), '0'],
                         stderr=subprocess.DEVNULL)
    end = time.time() + 10
    while subprocess.call(['mountpoint', '-q', mnt]) != 0:
        if time.time() > end or p.poll() is not None:
            raise RuntimeError('the store at %s did not mount' % mnt)
        time.sleep(0.1)
    return p


def slow_store_stop(mnt, p):
    subprocess.call(['fusermount', '-u', '-z', mnt])
    p.terminate()
    p.wait()


def bench_balance(work, quick):
    """four owners of two slots over one store (shared=on), a front on the
    same nginx; twenty sessions, four hot (long, short thinks, three of
    them of one home: the hash's worst case) and sixteen cold; the same
    seeded schedule and owner addresses on every side: hash consistent,
    least_conn, llama_session_balance, the balancer ignoring residency
    (plain bounded loads), and the balancer on two edges before the owners
    (an nginx of their own, as on other hosts).  Per side: returning
    turns' time to first token, hits, restores and re-prefills, in-flight
    turns per owner (busiest over mean, time-averaged over 100 ms samples
    with any load), tokens prefilled per owner (max over mean).
    BENCH_SEEDS: seeds (1); BENCH_THREADS: a llama-server's threads (1);
    BENCH_FA: its flash attention (off); BENCH_STORE_RATE: the store's
    bytes a second for slot files (128000000; 0: the page cache's speed);
    BENCH_SAVE_IDLE: the owners' save_idle= (2s);
    BENCH_BALANCE_SIDES: some of the sides (hash,least_conn,...);
    BENCH_TRACE: each session's turns, owner and kind"""
    import random
    import threading
    nback = 4
    seeds = [int(x) for x in os.environ.get('BENCH_SEEDS', '1').split(',')]
    hot_turns, cold_turns = (6, 2) if quick else (12, 4)
    # one thread a llama-server: four of them on this machine's two cores
    # with two threads each spin at ggml's barriers when all compute, and
    # spreading turns over the owners is then slower than it is on owners
    # of their own cores (BENCH_THREADS=2: the runs before this one)
    threads = int(os.environ.get('BENCH_THREADS', '1'))
    # the costs a model of real size has: a hit next to nothing, a restore
    # 0.1 to 0.3 s.  Flash attention off (llama-server's default, -fa
    # auto, turns it on, and ggml's CPU kernel takes 0.56 s for a returning
    # turn's 55 tokens after 2,400, 0.05 s without; BENCH_FA=auto: the
    # runs before 2026-12-07).  The rig's files are 8 kB a token, a real
    # model's 16 times more (an 8B model in f16: 128 kB): through a store
    # at 128 MB/s a 2,400-token session restores in 0.15 s, as such a
    # model's file read at 2 GB/s (BENCH_STORE_RATE=0: the page cache's
    # speed, a restore of a few ms; without FUSE too)
    fa = os.environ.get('BENCH_FA', 'off')
    rate = int(os.environ.get('BENCH_STORE_RATE', '128000000'))
    # a session idle that long is saved: longer than the hot sessions'
    # thinks (0.3 to 0.8 s), as docs/scaling.md tells operators to set it;
    # 300ms saves every hot turn, and a turn that comes back after the
    # save's call waits for it in llama-server (BENCH_SAVE_IDLE)
    save_idle = os.environ.get('BENCH_SAVE_IDLE', '2s')
    if rate and not (os.path.exists('/dev/fuse') and subprocess.call(
            ['/usr/bin/python3', '-c', 'import fusepy'],
            stderr=subprocess.DEVNULL) == 0):
        print('balance: no /dev/fuse or python3-fusepy: the store runs at '
              'the page cache\'s speed (BENCH_STORE_RATE=0)')
        rate = 0
    hot_tok, cold_tok = (768, (192, 384)) if quick else (1536, (256, 768))
    sides = [('hash', 'hash $llama_session_key consistent', 0),
             ('least_conn', 'least_conn', 0),
             ('balance', 'llama_session_balance', 0),
             ('bounded', 'llama_session_balance residency=off', 0),
             ('edges', 'llama_session_balance', 2)]
    if os.environ.get('BENCH_BALANCE_SIDES'):
        keep = os.environ['BENCH_BALANCE_SIDES'].split(',')
        sides = [x for x in sides if x[0] in keep]
    ports = [free_port() for _ in range(nback)]
    ring = balance_ring(ports)
    system = filler('sys', 200)
    res = {'owners': nback, 'slots': 2, 'seeds': seeds,
           'fa': fa, 'store_rate': rate, 'save_idle': save_idle}
    ctx = 2 * (hot_tok * 3 + 1024)
    # every seed's returning turns of a side together: a p95 of 112 turns
    # is its sixth slowest, of 336 its seventeenth
    pooled = {}

    for seed in seeds:
        rng = random.Random(seed)
        res[seed] = {}
        for side, balance, edges in sides:
            folder = os.path.join(work, 'balance-%s' % side)
            os.makedirs(folder, exist_ok=True)
            store = (slow_store(folder + '-root', folder, rate)
                     if rate else None)
            llamas = [Llama(work, 'balance-%s-%d' % (side, i), ctx, np=2,
                            slots=folder, threads=threads,
                            extra=['-fa', fa])
                      for i in range(nback)]
            ngx, port = fleet_nginx(
                work, 'nginx-balance-%s' % side, llamas, lambda i: folder,
                ' slots=2 shared=on save_idle=' + save_idle, balance, ports,
                edges)
            # edges: the owners on another nginx, as on other hosts, and a
            # session's turns alternate between two edge nginx instances
            # (what an L4 balancer in front of the edges does to it)
            ngxs, fports = (ngx, port) if edges else ([ngx], [port])

            # the sessions, the same on every side of a seed
            srng = random.Random(seed)
            words = {}

            def nwords(n):
                if n not in words:
                    words[n] = words_for(llamas[0].port, n, 'bw')
                return words[n]

            sessions, byhome, i = [], {}, 0
            while len([x for x in sessions if x['hot']]) < 4:
                sid = 'bal-%d-h%d' % (seed, i)
                first = filler('h%dw' % i, nwords(hot_tok)) + ' Q1?'
                home = balance_home(ring, balance_key(sid, system, first))
                byhome.setdefault(home, []).append((sid, first))
                i += 1
                three = [h for h in byhome if len(byhome[h]) >= 3]
                if three and not [x for x in sessions if x['hot']]:
                    for sid3, first3 in byhome[three[0]][:3]:
                        sessions.append({'sid': sid3, 'first': first3,
                                         'hot': True, 'home': three[0]})
                elif len([x for x in sessions if x['hot']]) == 3:
                    other = [h for h in byhome if h != sessions[0]['home']]
                    if other:
                        sid1, first1 = byhome[other[0]][0]
                        sessions.append({'sid': sid1, 'first': first1,
                                         'hot': True, 'home': other[0]})
            for c in range(16):
                sid = 'bal-%d-c%d' % (seed, c)
                n = srng.randint(*cold_tok)
                sessions.append({'sid': sid, 'hot': False,
                                 'first': filler('c%dw' % c, nwords(n))
                                 + ' Q1?'})
            for n, x in enumerate(sessions):
                x['n'] = n
                x['thinks'] = [srng.uniform(0.3, 0.8) if x['hot']
                               else srng.uniform(3.0, 8.0)
                               for _ in range(hot_turns if x['hot']
                                              else cold_turns)]
                x['msgs'] = [{'role': 'system', 'content': system},
                             {'role': 'user', 'content': x['first']}]

            rec, kinds, fill, spans, bykind, fresh = [], {}, {}, [], {}, []
            trace = {}
            lock = threading.Lock()
            redo = [0]

            def turn(x, rnd, timed):
                msgs = x['msgs']
                if rnd:
                    msgs.append({'role': 'user', 'content':
                                 'Q%d? %s' % (rnd + 1, filler('q', 8))})
                t0 = time.time()
                ttft, text, cache_n, prompt, _, hdrs = chat_turn(
                    fports[(x['n'] + rnd) % len(fports)], msgs, x['sid'], 4,
                    {'temperature': 0})
                t1 = time.time()
                msgs.append({'role': 'assistant', 'content': text})
                h = {k.lower(): v for k, v in hdrs.items()}
                b = h.get('x-backend', '?')
                with lock:
                    fill[b] = fill.get(b, 0) + prompt - (cache_n or 0)
                    trace.setdefault(x['sid'], []).append(
                        '%s%s%s' % (b[1:], h.get('x-s-action', '?')[0],
                                    '!' if (cache_n or 0) < 0.9 * prompt
                                    else ''))
                    if timed:
                        rec.append(ttft)
                        spans.append((t0, t1, b))
                        k = h.get('x-s-action', '?')
                        kinds[k] = kinds.get(k, 0) + 1
                        bykind.setdefault(k, []).append(ttft)
                        if (cache_n or 0) < 0.9 * prompt:
                            redo[0] += 1
                        if k == 'fresh':
                            fresh.append(x['sid'])

            # first turns before the clock, one at a time
            for x in sessions:
                turn(x, 0, False)
            time.sleep(1)
            fill.clear()

            def client(x):
                for rnd, think in enumerate(x['thinks'], 1):
                    time.sleep(think)
                    turn(x, rnd, True)

            th = [threading.Thread(target=client, args=(x,))
                  for x in sessions]
            for t in th:
                t.start()
            for t in th:
                t.join()

            # in flight per owner, sampled every 100 ms: each owner's
            # average over the run, the busiest over their mean
            lo = min(a for a, _, _ in spans)
            hi = max(b for _, b, _ in spans)
            avg, t, nsamples = [0.0] * nback, lo, 0
            while t < hi:
                for a, b, o in spans:
                    if a <= t < b:
                        avg[int(o[1:])] += 1
                nsamples += 1
                t += 0.1
            avg = [x / nsamples for x in avg]
            pre = [fill.get('o%d' % k, 0) for k in range(nback)]
            n = len(rec)
            r = {'p50': median(rec), 'p95': p95(rec), 'samples': n,
                 'kinds': kinds,
                 'hit_share': kinds.get('hit', 0) / float(n),
                 'reprefill_share': redo[0] / float(n),
                 'inflight': avg,
                 'inflight_max_over_mean':
                     max(avg) / (sum(avg) / float(nback)) if sum(avg)
                     else None,
                 'p50_by_kind': {k: median(v) for k, v in bykind.items()},
                 'p95_by_kind': {k: p95(v) for k, v in bykind.items()},
                 'prefilled': pre,
                 'prefilled_max_over_mean':
                     max(pre) / (sum(pre) / float(nback)) if sum(pre)
                     else None}
            res[seed][side] = r
            all_ = pooled.setdefault(side, {'ttft': [], 'hit': 0})
            all_['ttft'] += rec
            all_['hit'] += kinds.get('hit', 0)
            print('balance seed %d %-10s p50 / p95 %s / %s s; hits %.0f %%, '
                  're-prefilled %.0f %% (%s); in flight busiest/mean %.2f; '
                  'prefilled max/mean %.2f (%s); p50 by kind %s'
                  % (seed, side, fmt(r['p50']), fmt(r['p95']),
                     100 * r['hit_share'], 100 * r['reprefill_share'],
                     ', '.join('%s %d' % kv for kv in sorted(kinds.items())),
                     r['inflight_max_over_mean'] or 0,
                     r['prefilled_max_over_mean'] or 0,
                     '/'.join(str(v) for v in pre),
                     ', '.join('%s %s' % (k, fmt(v)) for k, v
                               in sorted(r['p50_by_kind'].items()))))
            # BENCH_TRACE: each session's turns, owner and kind (1h: a hit
            # on o1, 2r: a restore on o2, f: fresh; !: under 90 % cached),
            # first turn first
            if os.environ.get('BENCH_TRACE'):
                for x in sessions:
                    print('  %-12s %s %s' % (x['sid'],
                                             'hot ' if x['hot'] else 'cold',
                                             ' '.join(trace.get(x['sid'],
                                                                []))))
            # a returning turn of a session with a file made fresh: what
            # the owners' logs say of it (a re-prefill is never expected)
            for sid in fresh:
                for n in ngxs:
                    with open(os.path.join(n.dir, 'error.log'),
                              errors='replace') as f:
                        for line in f:
                            if sid + '-' in line and ('[info]' not in line
                                                or 'swap' in line
                                                or 'restore' in line):
                                print('  %s: %s' % (sid, line.strip()[:300]))
            sys.stdout.flush()
            for n in ngxs:
                n.stop()
            for ll in llamas:
                ll.stop()
            if store:
                slow_store_stop(folder, store)
                shutil.rmtree(folder + '-root', ignore_errors=True)
            shutil.rmtree(folder, ignore_errors=True)
    if len(seeds) > 1:
        res['pooled'] = {}
        for side, all_ in pooled.items():
            v = all_['ttft']
            res['pooled'][side] = {'p50': median(v), 'p95': p95(v),
                                   'samples': len(v),
                                   'hit_share': all_['hit'] / float(len(v))}
            print('balance seeds %s %-10s p50 / p95 %s / %s s; hits %.0f %% '
                  'of %d' % (','.join(map(str, seeds)), side,
                             fmt(median(v)), fmt(p95(v)),
                             100.0 * all_['hit'] / len(v), len(v)))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--out', default=os.path.join(ROOT, 'bench', 'results',
                                                  'latest.json'))
    ap.add_argument('--only',
                    default='ttft,swap,hit,scale,warm,team,oneslot,models,'
                            'kvq,clients,fleet,returning,budget,balance')
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--full', action='store_true',
                    help='the whole grid: 2, 4, 8 sessions of 8k and 16k '
                         'tokens too (about 30 minutes more)')
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix='llama-session-bench.')
    result = {'command': ' '.join(sys.argv),
              'date': time.strftime('%Y-%m-%d %H:%M:%S %Z'),
              'machine': {'cpus': os.cpu_count(),
                          'cpu': platform.processor() or platform.machine(),
                          'kernel': platform.release()}}
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    result['machine']['cpu'] = line.split(':', 1)[1].strip()
                    break
    except OSError:
        pass
    t0 = time.time()
    try:
        for part in args.only.split(','):
            t1 = time.time()
            fn = globals()['bench_' + part]
            result[part] = (fn(work, args.quick, args.full)
                            if part in ('ttft', 'team')
                            else fn(work, args.quick))
            result[part + '_seconds'] = round(time.time() - t1, 1)
    finally:
        result['seconds'] = round(time.time() - t0, 1)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, 'w') as f:
            json.dump(result, f, indent=1)
        if os.environ.get('BENCH_KEEP'):
            print('kept the work folder: ' + work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print('results: %s (%.0f s)' % (args.out, result['seconds']))


if __name__ == '__main__':
    main()
