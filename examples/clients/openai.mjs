// The official OpenAI SDK against nginx with the llama_session module.
// A conversation is identified by what the app already sends: either
// prompt_cache_key (OpenAI's own field for this, one per conversation) or
// a session header set once per client with defaultHeaders.
//
//   npm install openai
//   LLAMA_BASE_URL=http://127.0.0.1:8081/v1 node openai.mjs [key|header]
//
// Prints, for each turn, the prompt tokens and how many came from the
// cache (usage.prompt_tokens_details.cached_tokens).

import OpenAI from 'openai';

const baseURL = process.env.LLAMA_BASE_URL ?? 'http://127.0.0.1:8081/v1';
const mode = process.argv[2] ?? 'key';
const notes = (who) => Array.from({ length: 40 },
    (_, i) => `${who} keeps note ${i + 1}.`).join(' ');

function conversation(id) {
    const client = new OpenAI({
        baseURL,
        apiKey: process.env.OPENAI_API_KEY ?? 'none',
        // the header way: every request of this client is the session's
        ...(mode === 'header' ? { defaultHeaders: { 'X-Session-Id': id } } : {}),
    });
    const messages = [{ role: 'user', content: notes(id) }];

    return async function turn() {
        const r = await client.chat.completions.create({
            model: process.env.LLAMA_MODEL ?? 'any',
            messages,
            max_tokens: 2,
            temperature: 0,
            // the field way: OpenAI's prompt_cache_key names the conversation
            ...(mode === 'key' ? { prompt_cache_key: id } : {}),
        });
        messages.push(r.choices[0].message, { role: 'user', content: `More, ${id}.` });
        return { id, prompt: r.usage.prompt_tokens,
                 cached: r.usage.prompt_tokens_details?.cached_tokens ?? 0 };
    };
}

const a = conversation('chat-a');
const b = conversation('chat-b');
const turns = [await a(), await b(), await a(), await b()];
console.log(JSON.stringify(turns));
