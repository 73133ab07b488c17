// The official Anthropic SDK against nginx with the llama_session module
// (llama-server speaks /v1/messages).  Point ANTHROPIC_BASE_URL at nginx,
// as Claude Code users do.  Claude Code sends X-Claude-Code-Session-Id on
// every request of a session (its subagents and side queries too); an app
// on the SDK sets a session header of its own with defaultHeaders.  The
// Anthropic body has no conversation id the module could use.
//
//   npm install @anthropic-ai/sdk
//   ANTHROPIC_BASE_URL=http://127.0.0.1:8081 node anthropic.mjs
//
// Prints each turn's input tokens and cache_read_input_tokens.

import Anthropic from '@anthropic-ai/sdk';

const baseURL = process.env.ANTHROPIC_BASE_URL ?? 'http://127.0.0.1:8081';
const notes = (who) => Array.from({ length: 40 },
    (_, i) => `${who} keeps note ${i + 1}.`).join(' ');

function conversation(id, header) {
    const client = new Anthropic({
        baseURL,
        apiKey: process.env.ANTHROPIC_API_KEY ?? 'none',
        defaultHeaders: { [header]: id },
    });
    const messages = [{ role: 'user', content: notes(id) }];

    return async function turn() {
        const r = await client.messages.create({
            model: process.env.LLAMA_MODEL ?? 'any',
            system: 'You answer briefly.',
            messages,
            max_tokens: 2,
            temperature: 0,
        });
        const text = r.content.filter((c) => c.type === 'text')
                              .map((c) => c.text).join('') || '.';
        messages.push({ role: 'assistant', content: text },
                      { role: 'user', content: `More, ${id}.` });
        return { id, input: r.usage.input_tokens,
                 cached: r.usage.cache_read_input_tokens ?? 0 };
    };
}

// one as Claude Code sends it, one as an app with a header of its own
const a = conversation('2f1c7c36-claude-code-session', 'X-Claude-Code-Session-Id');
const b = conversation('app-session-b', 'X-Session-Id');
const turns = [await a(), await b(), await a(), await b()];
console.log(JSON.stringify(turns));
