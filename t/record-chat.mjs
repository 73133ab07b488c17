#!/usr/bin/env node
// A tiny stand-in for the OpenAI Chat Completions API that records what a
// client (Qwen Code, pi, say) sends.  No dependencies.
//
//   node t/record-chat.mjs PORT FILE
//
// Records every request as t/lib/record.mjs says, and answers:
//   POST .../chat/completions[?...]   a reply whose text is "Hi." -- an SSE
//                                     stream of chat.completion.chunk events
//                                     (the last one with finish_reason
//                                     "stop" and usage, then [DONE]) when
//                                     the body has stream:true, else one
//                                     chat.completion object
//   GET .../models[?...]              {"object":"list","data":[{"id":"tiny",...}]}
//   anything else                     404 with an OpenAI error body

import { TEXT, hex, json, notFound, serve } from './lib/record.mjs';

const model = (body) =>
    (body && typeof body === 'object' && typeof body.model === 'string')
        ? body.model : 'tiny';

const usage = () => ({
    prompt_tokens: 10,
    completion_tokens: 2,
    total_tokens: 12,
    prompt_tokens_details: { cached_tokens: 0 },
    completion_tokens_details: { reasoning_tokens: 0 },
});

function whole(res, body) {
    json(res, 200, {
        id: 'chatcmpl-' + hex(12),
        object: 'chat.completion',
        created: Math.floor(Date.now() / 1000),
        model: model(body),
        choices: [{
            index: 0,
            message: { role: 'assistant', content: TEXT, refusal: null },
            logprobs: null,
            finish_reason: 'stop',
        }],
        usage: usage(),
        system_fingerprint: null,
    }, 'x-request-id');
}

function streamed(res, body) {
    res.writeHead(200, {
        'content-type': 'text/event-stream',
        'cache-control': 'no-cache',
        'x-request-id': 'req_' + hex(12),
    });
    const id = 'chatcmpl-' + hex(12), created = Math.floor(Date.now() / 1000);
    const chunk = (delta, finish, extra) => res.write(`data: ${JSON.stringify({
        id, object: 'chat.completion.chunk', created, model: model(body),
        system_fingerprint: null,
        choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }],
        ...extra })}\n\n`);

    chunk({ role: 'assistant', content: '' }, null);
    chunk({ content: TEXT }, null);
    chunk({}, 'stop', { usage: usage() });
    res.write('data: [DONE]\n\n');
    res.end();
}

serve('record-chat.mjs', (req, res, path, body) => {
    if (req.method === 'POST' && path.endsWith('/chat/completions')) {
        if (body && typeof body === 'object' && body.stream === true)
            streamed(res, body);
        else
            whole(res, body);
    } else if (req.method === 'GET' && path.endsWith('/models')) {
        json(res, 200, { object: 'list', data: [
            { id: 'tiny', object: 'model', owned_by: 'local' }] },
             'x-request-id');
    } else {
        notFound(res, req.method, path);
    }
}, 'x-request-id');
