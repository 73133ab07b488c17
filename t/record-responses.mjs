#!/usr/bin/env node
// A tiny stand-in for the OpenAI Responses API that records what a client
// (the Codex CLI, say) sends.  No dependencies.
//
//   node t/record-responses.mjs PORT FILE
//
// Listens on 127.0.0.1:PORT (0 picks a free port) and prints
// "listening 127.0.0.1:PORT" on stdout once it accepts connections.  Every
// request is appended to FILE as one JSON line:
//   {"seq":N,"time":"ISO-8601","method":...,"path":...,"headers":{...},
//    "body":<parsed JSON, or the raw text when it is not JSON, or null>}
// and answered:
//   POST .../responses[?...]   a Responses reply whose text is "Hi." -- an SSE
//                              stream of response.* events when the body has
//                              stream:true, else one response object
//   GET .../models[?...]       {"object":"list","data":[{"id":"tiny",...}]}
//   anything else              404 with an OpenAI error body (a WebSocket
//                              upgrade too, so clients fall back to HTTP)
// SIGTERM/SIGINT end it.

import http from 'node:http';
import fs from 'node:fs';
import zlib from 'node:zlib';
import crypto from 'node:crypto';

const [port, file] = process.argv.slice(2);
if (port === undefined || file === undefined) {
    process.stderr.write('usage: record-responses.mjs PORT FILE\n');
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

const hex = (n) => crypto.randomBytes(n).toString('hex');

function json(res, status, obj) {
    const s = JSON.stringify(obj);
    res.writeHead(status, {
        'content-type': 'application/json',
        'content-length': Buffer.byteLength(s),
        'x-request-id': 'req_' + hex(12),
    });
    res.end(s);
}

function notFound(res, method, path) {
    json(res, 404, { error: {
        message: `${method} ${path} not found`,
        type: 'invalid_request_error', param: null, code: 'not_found',
    } });
}

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
    json(res, 200, response(body, 'resp_' + hex(12), 'completed', out));
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

const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
        let raw = Buffer.concat(chunks);
        try { raw = decode(raw, req.headers['content-encoding']); } catch { /* keep raw */ }
        const body = record(req, raw.toString('utf8'));
        const path = req.url.split('?')[0];

        if (req.method === 'POST' && path.endsWith('/responses')) {
            if (body && typeof body === 'object' && body.stream === true)
                streamed(res, body);
            else
                whole(res, body);
        } else if (req.method === 'GET' && path.endsWith('/models')) {
            json(res, 200, { object: 'list', data: [{ id: 'tiny', object: 'model' }] });
        } else {
            notFound(res, req.method, path);
        }
    });
});

// A WebSocket upgrade is recorded and refused with a plain 404.
server.on('upgrade', (req, socket) => {
    record(req, '');
    const s = JSON.stringify({ error: { message: 'websocket not supported',
        type: 'invalid_request_error', param: null, code: 'not_found' } });
    socket.end('HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n' +
        `content-length: ${Buffer.byteLength(s)}\r\nconnection: close\r\n\r\n${s}`);
});

server.listen(Number(port), '127.0.0.1', () => {
    process.stdout.write(`listening 127.0.0.1:${server.address().port}\n`);
});
for (const sig of ['SIGTERM', 'SIGINT'])
    process.on(sig, () => process.exit(0));
