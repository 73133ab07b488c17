#!/usr/bin/env node
// A tiny stand-in for the Anthropic Messages API that records what a client
// sends.  No dependencies.
//
//   node t/record-anthropic.mjs PORT FILE
//
// Listens on 127.0.0.1:PORT (0 picks a free port) and prints
// "listening 127.0.0.1:PORT" on stdout once it accepts connections.  Every
// request is appended to FILE as one JSON line:
//   {"seq":N,"time":"ISO-8601","method":...,"path":...,"headers":{...},
//    "body":<parsed JSON, or the raw text when it is not JSON, or null>}
// and answered:
//   POST /v1/messages[?...]            a Messages reply whose text is "Hi." --
//                                      SSE when the body has stream:true,
//                                      else one JSON message
//   POST /v1/messages/count_tokens     {"input_tokens": 10}
//   anything else                      404 with an Anthropic error body
// SIGTERM/SIGINT end it.

import http from 'node:http';
import fs from 'node:fs';
import zlib from 'node:zlib';
import crypto from 'node:crypto';

const [port, file] = process.argv.slice(2);
if (port === undefined || file === undefined) {
    process.stderr.write('usage: record-anthropic.mjs PORT FILE\n');
    process.exit(2);
}

const TEXT = 'Hi.';
let seq = 0;

function decode(raw, encoding) {
    switch ((encoding || '').trim().toLowerCase()) {
    case 'gzip': case 'x-gzip': return zlib.gunzipSync(raw);
    case 'deflate': return zlib.inflateSync(raw);
    case 'br': return zlib.brotliDecompressSync(raw);
    case 'zstd': return zlib.zstdDecompressSync ? zlib.zstdDecompressSync(raw) : raw;
    default: return raw;
    }
}

function record(req, text) {
    let body = null;
    if (text.length) {
        try { body = JSON.parse(text); } catch { body = text; }
    }
    const line = {
        seq: ++seq,
        time: new Date().toISOString(),
        method: req.method,
        path: req.url,
        headers: req.headers,
        body,
    };
    // synchronous, so lines keep their order and survive a kill
    fs.appendFileSync(file, JSON.stringify(line) + '\n');
    return body;
}

function json(res, status, obj) {
    const s = JSON.stringify(obj);
    res.writeHead(status, {
        'content-type': 'application/json',
        'content-length': Buffer.byteLength(s),
        'request-id': 'req_' + crypto.randomBytes(12).toString('hex'),
    });
    res.end(s);
}

function messageId() {
    return 'msg_' + crypto.randomBytes(12).toString('hex');
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
    });
}

function streamed(res, body) {
    res.writeHead(200, {
        'content-type': 'text/event-stream',
        'cache-control': 'no-cache',
        'request-id': 'req_' + crypto.randomBytes(12).toString('hex'),
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

const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
        let raw = Buffer.concat(chunks);
        try { raw = decode(raw, req.headers['content-encoding']); } catch { /* keep raw */ }
        const body = record(req, raw.toString('utf8'));
        const path = req.url.split('?')[0];

        if (req.method === 'POST' && path === '/v1/messages') {
            if (body && typeof body === 'object' && body.stream === true)
                streamed(res, body);
            else
                whole(res, body);
        } else if (req.method === 'POST' && path === '/v1/messages/count_tokens') {
            json(res, 200, { input_tokens: 10 });
        } else {
            json(res, 404, { type: 'error', error: {
                type: 'not_found_error', message: `${req.method} ${path} not found`,
            } });
        }
    });
});

server.listen(Number(port), '127.0.0.1', () => {
    process.stdout.write(`listening 127.0.0.1:${server.address().port}\n`);
});
for (const sig of ['SIGTERM', 'SIGINT'])
    process.on(sig, () => process.exit(0));
