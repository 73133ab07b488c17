#!/usr/bin/python3
# turn.py HOST SID [TIMEOUT]: one turn of session SID on HOST's owner
# (curl inside the netns), as t/43's turn(): system prompt of 40 sentences,
# a first user message of 40, max_tokens 2, temperature 0; on 200 the
# reply and a new user message are appended (conv/SID.json).  Prints one
# line: time host sid status action prompt cached secs
import json, os, subprocess, sys, time
host, sid = sys.argv[1], sys.argv[2]
timeout = sys.argv[3] if len(sys.argv) > 3 else '300'
d = os.environ.get('NFS_EXP', '/tmp/nfs-exp') + '/conv'
os.makedirs(d, exist_ok=True)
f = f'{d}/{sid}.json'
system = ' '.join(f'Rule {i} of the house.' for i in range(1, 41))
conv = json.load(open(f)) if os.path.exists(f) else [
    {'role': 'system', 'content': system},
    {'role': 'user', 'content': ' '.join(f'Session {sid} note {i}.' for i in range(1, 41))}]
body = f'{d}/{sid}.req'
json.dump({'messages': conv, 'max_tokens': 2, 'temperature': 0}, open(body, 'w'))
t0 = time.time()
start = time.strftime('%H:%M:%S')
p = subprocess.run(['ip', 'netns', 'exec', host, 'curl', '-s', '-m', timeout,
                    '-D', f'{d}/{sid}.hdr', '-o', f'{d}/{sid}.out',
                    '-w', '%{http_code}', '-H', 'Content-Type: application/json',
                    '-H', f'X-Session-Id: {sid}', '--data-binary', f'@{body}',
                    'http://127.0.0.1:8080/v1/chat/completions'],
                   capture_output=True, text=True)
secs = time.time() - t0
status = p.stdout.strip() or '000'
hdr = {}
try:
    for l in open(f'{d}/{sid}.hdr'):
        if ':' in l:
            k, v = l.split(':', 1); hdr[k.strip().lower()] = v.strip()
except OSError:
    pass
prompt = cached = '-'
if status == '200':
    r = json.load(open(f'{d}/{sid}.out'))
    prompt = r['usage']['prompt_tokens']
    cached = r['usage'].get('prompt_tokens_details', {}).get('cached_tokens')
    conv += [{'role': 'assistant', 'content': r['choices'][0]['message']['content']},
             {'role': 'user', 'content': f'More for {sid}?'}]
    json.dump(conv, open(f, 'w'))
else:
    try:
        print('  body:', open(f'{d}/{sid}.out').read()[:300])
    except OSError:
        pass
pct = f' ({100*cached/prompt:.0f}%)' if isinstance(prompt, int) and isinstance(cached, int) and prompt else ''
print(f'{start} {host} {sid}: HTTP {status} (curl rc {p.returncode}) action={hdr.get("x-s-action","-")} '
      f'prompt={prompt} cached={cached}{pct} {secs:.2f}s', flush=True)
