// What Open WebUI sends to an OpenAI connection pointed at nginx (see
// ../openwebui.conf), played with the OpenAI SDK: with
// ENABLE_FORWARD_USER_INFO_HEADERS=true, every request of a chat carries
// X-OpenWebUI-Chat-Id, and after the first answer Open WebUI sends its
// title and follow-up requests under the same chat id with prompts of
// their own.  The module gives those side requests sessions of their own,
// so the chat's cache is still there on its next turn.

import OpenAI from 'openai';

const baseURL = process.env.LLAMA_BASE_URL ?? 'http://127.0.0.1:8081/v1';
const notes = (who) => Array.from({ length: 40 },
    (_, i) => `${who} keeps note ${i + 1}.`).join(' ');

function chat(id) {
    const client = new OpenAI({
        baseURL,
        apiKey: 'none',
        defaultHeaders: {
            'X-OpenWebUI-Chat-Id': id,
            'X-OpenWebUI-User-Id': '7d8bbf1e-0c55-4f0c-a9f9-4ac4b4e0f0aa',
            'X-OpenWebUI-User-Role': 'user',
        },
    });
    const messages = [{ role: 'system', content: 'You are a helpful assistant.' },
                      { role: 'user', content: notes(id) }];

    async function send(body) {
        const r = await client.chat.completions.create({
            model: 'any', max_tokens: 2, temperature: 0, ...body });
        return r;
    }

    return {
        async turn() {
            const r = await send({ messages });
            messages.push(r.choices[0].message,
                          { role: 'user', content: `More, ${id}.` });
            return { id, prompt: r.usage.prompt_tokens,
                     cached: r.usage.prompt_tokens_details?.cached_tokens ?? 0 };
        },
        async title() {
            // Open WebUI's title task: one user message holding the chat
            const history = messages.map((m) => `${m.role}: ${m.content}`).join('\n');
            await send({ messages: [{ role: 'user', content:
                '### Task:\nGenerate a concise, 3-5 word title with an emoji '
                + 'summarizing the chat history.\n### Chat History:\n<chat_history>\n'
                + history + '\n</chat_history>' }], stream: false });
        },
    };
}

const a = chat('3b9e6c1d-5d2a-4f8e-9b61-0c4e1f2a7d11');
const b = chat('temporary:Xk3v9QpL2mNsT8wA');
const out = [await a.turn()];
await a.title();
out.push(await b.turn());
await b.title();
out.push(await a.turn(), await b.turn());
console.log(JSON.stringify(out));
