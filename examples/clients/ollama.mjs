// The official Ollama JavaScript client against nginx with
// llama_session_ollama on (llama-server behind it speaks no Ollama): chat
// and generate, streamed (Ollama's default) and not.  Ollama's body has no
// conversation id: give each conversation a header of its own (the client
// takes headers), or let the module know it by its system prompt and
// first message.
//
//   npm install ollama
//   OLLAMA_HOST=http://127.0.0.1:11434 node ollama.mjs
//
// Prints each turn's prompt_eval_count (tokens evaluated, not from the
// cache), the reply's text and its done_reason.

import { Ollama } from 'ollama';

const host = process.env.OLLAMA_HOST ?? 'http://127.0.0.1:11434';
const notes = (who) => Array.from({ length: 40 },
    (_, i) => `${who} keeps note ${i + 1}.`).join(' ');

function conversation(id, stream, header = true) {
    // without a header, the module knows the conversation by its system
    // prompt and its first message
    const ollama = new Ollama({ host,
        ...(header ? { headers: { 'X-Session-Id': id } } : {}) });
    const messages = [{ role: 'system', content: 'You answer briefly.' },
                      { role: 'user', content: notes(id) }];

    return async function turn() {
        const request = { model: process.env.LLAMA_MODEL ?? 'any', messages,
                          stream, options: { num_predict: 3, temperature: 0,
                                             seed: 7 } };
        let last, text = '';
        if (stream) {
            for await (const part of await ollama.chat(request)) {
                text += part.message.content;
                last = part;
            }
        } else {
            last = await ollama.chat(request);
            text = last.message.content;
        }
        messages.push({ role: 'assistant', content: text },
                      { role: 'user', content: `More, ${id}.` });
        return { id, stream, evaluated: last.prompt_eval_count,
                 eval_count: last.eval_count, done: last.done,
                 done_reason: last.done_reason, text };
    };
}

const a = conversation('ollama-a', true);
const b = conversation('ollama-b', false);
const c = conversation('ollama-c', true, false);
const turns = [await a(), await b(), await a(), await b(), await c(),
               await a(), await c()];

const ollama = new Ollama({ host });
const gen = await ollama.generate({ model: 'any', prompt: 'Say hi.',
                                    system: 'You are terse.', stream: false,
                                    options: { num_predict: 2 } });
let streamed = '', parts = 0, lastPart;
for await (const part of await ollama.generate({ model: 'any',
        prompt: 'Say hello.', stream: true, options: { num_predict: 3 } })) {
    streamed += part.response;
    parts++;
    lastPart = part;
}
const version = await ollama.version();
const tags = await ollama.list();
const ps = await ollama.ps();
const show = await ollama.show({ model: tags.models[0].name });
console.log(JSON.stringify({ turns, generate: { done: gen.done,
    response: gen.response, eval_count: gen.eval_count },
    generate_stream: { parts, done: lastPart.done,
                       eval_count: lastPart.eval_count },
    version: version.version, tags: tags.models.map((m) => m.name),
    ps: ps.models.length, show: show.details.format }));
