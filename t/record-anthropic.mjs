#!/usr/bin/env node
// A tiny stand-in for the Anthropic Messages API that records what a client
// sends.  No dependencies.
//
//   node t/record-anthropic.mjs PORT FILE
//
// Records every request as t/lib/record.mjs says, and answers:
//   POST /v1/messages[?...]            a Messages reply whose text is "Hi." --
//                                      SSE when the body has stream:true,
//                                      else one JSON message
//   POST /v1/messages/count_tokens     {"input_tokens": 10}
//   anything else                      404 with an Anthropic error body

import { TEXT, hex, json, serve } from './lib/record.mjs';

function messageId() {
    return 'msg_' + hex(12);
}

function model(body) {
    return (body && typeof body === 'object' && typeof body.model === 'string')
        ? body.model : 'claude-test';
}

function whole(res, body) {
    json(res, 200, {
        id: messageId(),
        type: 'message',
        role: 'assistant',
        model: model(body),
        content: [{ type: 'text', text: TEXT }],
        stop_reason: 'end_turn',
        stop_sequence: null,
        usage: { input_tokens: 10, output_tokens: 2 },
    }, 'request-id');
}

function streamed(res, body) {
    res.writeHead(200, {
        'content-type': 'text/event-stream',
        'cache-control': 'no-cache',
        'request-id': 'req_' + hex(12),
    });
    const ev = (type, data) =>
        res.write(`event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`);
    ev('message_start', { message: {
        id: messageId(), type: 'message', role: 'assistant', model: model(body),
        content: [], stop_reason: null, stop_sequence: null,
        usage: { input_tokens: 10, output_tokens: 1 },
    } });
    ev('content_block_start', { index: 0, content_block: { type: 'text', text: '' } });
    ev('content_block_delta', { index: 0, delta: { type: 'text_delta', text: TEXT } });
    ev('content_block_stop', { index: 0 });
    ev('message_delta', {
        delta: { stop_reason: 'end_turn', stop_sequence: null },
        usage: { input_tokens: 10, output_tokens: 2 },
    });
    ev('message_stop', {});
    res.end();
}

serve('record-anthropic.mjs', (req, res, path, body) => {
    if (req.method === 'POST' && path === '/v1/messages') {
        if (body && typeof body === 'object' && body.stream === true)
            streamed(res, body);
        else
            whole(res, body);
    } else if (req.method === 'POST' && path === '/v1/messages/count_tokens') {
        json(res, 200, { input_tokens: 10 }, 'request-id');
    } else {
        json(res, 404, { type: 'error', error: {
            type: 'not_found_error', message: `${req.method} ${path} not found`,
        } }, 'request-id');
    }
}, 'request-id');
