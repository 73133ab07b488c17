#!/usr/bin/env node
// A tiny stand-in for the OpenAI Responses API that records what a client
// (the Codex CLI, say) sends.  No dependencies.
//
//   node t/record-responses.mjs PORT FILE
//
// Records every request as t/lib/record.mjs says, and answers:
//   POST .../responses[?...]   a Responses reply whose text is "Hi." -- an SSE
//                              stream of response.* events when the body has
//                              stream:true, else one response object
//   GET .../models[?...]       {"object":"list","data":[{"id":"tiny",...}]}
//   anything else              404 with an OpenAI error body (a WebSocket
//                              upgrade too, so clients fall back to HTTP)

import { TEXT, hex, json, notFound, serve } from './lib/record.mjs';

const str = (body, key, dflt) =>
    (body && typeof body === 'object' && typeof body[key] === 'string') ? body[key] : dflt;

const usage = () => ({
    input_tokens: 10,
    input_tokens_details: { cached_tokens: 0 },
    output_tokens: 2,
    output_tokens_details: { reasoning_tokens: 0 },
    total_tokens: 12,
});

// The response object, as it stands while in progress or once completed.
function response(body, id, status, output) {
    const b = (body && typeof body === 'object') ? body : {};
    return {
        id,
        object: 'response',
        created_at: Math.floor(Date.now() / 1000),
        status,
        error: null,
        incomplete_details: null,
        instructions: b.instructions ?? null,
        max_output_tokens: b.max_output_tokens ?? null,
        model: str(body, 'model', 'tiny'),
        output,
        parallel_tool_calls: b.parallel_tool_calls ?? true,
        previous_response_id: b.previous_response_id ?? null,
        reasoning: { effort: null, summary: null },
        store: b.store ?? false,
        temperature: 1.0,
        text: { format: { type: 'text' } },
        tool_choice: b.tool_choice ?? 'auto',
        tools: [],
        top_p: 1.0,
        truncation: 'disabled',
        usage: status === 'completed' ? usage() : null,
        user: null,
        metadata: {},
    };
}

const part = (text) => ({ type: 'output_text', text, annotations: [], logprobs: [] });

function message(id, status, content) {
    return { id, type: 'message', status, role: 'assistant', content };
}

function whole(res, body) {
    const out = [message('msg_' + hex(12), 'completed', [part(TEXT)])];
    json(res, 200, response(body, 'resp_' + hex(12), 'completed', out),
         'x-request-id');
}

function streamed(res, body) {
    res.writeHead(200, {
        'content-type': 'text/event-stream',
        'cache-control': 'no-cache',
        'x-request-id': 'req_' + hex(12),
    });
    let n = 0;
    const ev = (type, data) => res.write(`event: ${type}\ndata: ${
        JSON.stringify({ type, sequence_number: n++, ...data })}\n\n`);
    const rid = 'resp_' + hex(12), mid = 'msg_' + hex(12);
    const at = { item_id: mid, output_index: 0, content_index: 0 };
    const done = message(mid, 'completed', [part(TEXT)]);

    ev('response.created', { response: response(body, rid, 'in_progress', []) });
    ev('response.in_progress', { response: response(body, rid, 'in_progress', []) });
    ev('response.output_item.added',
        { output_index: 0, item: message(mid, 'in_progress', []) });
    ev('response.content_part.added', { ...at, part: part('') });
    ev('response.output_text.delta', { ...at, delta: TEXT, logprobs: [] });
    ev('response.output_text.done', { ...at, text: TEXT, logprobs: [] });
    ev('response.content_part.done', { ...at, part: part(TEXT) });
    ev('response.output_item.done', { output_index: 0, item: done });
    ev('response.completed', { response: response(body, rid, 'completed', [done]) });
    res.end();
}

serve('record-responses.mjs', (req, res, path, body) => {
    if (req.method === 'POST' && path.endsWith('/responses')) {
        if (body && typeof body === 'object' && body.stream === true)
            streamed(res, body);
        else
            whole(res, body);
    } else if (req.method === 'GET' && path.endsWith('/models')) {
        json(res, 200, { object: 'list', data: [{ id: 'tiny', object: 'model' }] },
             'x-request-id');
    } else {
        notFound(res, req.method, path);
    }
}, 'x-request-id');
