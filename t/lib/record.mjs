// What the recording stand-ins (t/record-anthropic.mjs,
// t/record-responses.mjs) share: the command line (PORT FILE), the request
// recorded as one JSON line of FILE, JSON answers, the server.
//
// Every request is appended to FILE as
//   {"seq":N,"time":"ISO-8601","method":...,"path":...,"headers":{...},
//    "body":<parsed JSON, or the raw text when it is not JSON, or null>}
// The server listens on 127.0.0.1:PORT (0 picks a free port) and prints
// "listening 127.0.0.1:PORT" once it accepts connections; SIGTERM/SIGINT
// end it.

import http from 'node:http';
import fs from 'node:fs';
import zlib from 'node:zlib';
import crypto from 'node:crypto';

export const TEXT = 'Hi.';
export const hex = (n) => crypto.randomBytes(n).toString('hex');

function decode(raw, encoding) {
    switch ((encoding || '').trim().toLowerCase()) {
    case 'gzip': case 'x-gzip': return zlib.gunzipSync(raw);
    case 'deflate': return zlib.inflateSync(raw);
    case 'br': return zlib.brotliDecompressSync(raw);
    case 'zstd': return zlib.zstdDecompressSync ? zlib.zstdDecompressSync(raw) : raw;
    default: return raw;
    }
}

export function json(res, status, obj, idHeader) {
    const s = JSON.stringify(obj);
    res.writeHead(status, {
        'content-type': 'application/json',
        'content-length': Buffer.byteLength(s),
        [idHeader]: 'req_' + hex(12),
    });
    res.end(s);
}

// OpenAI's 404, with its error body (a WebSocket upgrade gets it too, so
// clients fall back to HTTP)
export function notFound(res, method, path) {
    json(res, 404, { error: {
        message: `${method} ${path} not found`,
        type: 'invalid_request_error', param: null, code: 'not_found',
    } }, 'x-request-id');
}

// serve(name, route, idHeader): route(req, res, path, body) answers
export function serve(name, route, idHeader) {
    const [port, file] = process.argv.slice(2);
    if (port === undefined || file === undefined) {
        process.stderr.write(`usage: ${name} PORT FILE\n`);
        process.exit(2);
    }

    let seq = 0;

    const record = (req, text) => {
        let body = null;
        if (text.length) {
            try { body = JSON.parse(text); } catch { body = text; }
        }
        // synchronous, so lines keep their order and survive a kill
        fs.appendFileSync(file, JSON.stringify({
            seq: ++seq, time: new Date().toISOString(), method: req.method,
            path: req.url, headers: req.headers, body,
        }) + '\n');
        return body;
    };

    const server = http.createServer((req, res) => {
        const chunks = [];
        req.on('data', (c) => chunks.push(c));
        req.on('end', () => {
            let raw = Buffer.concat(chunks);
            try { raw = decode(raw, req.headers['content-encoding']); } catch { /* keep raw */ }
            const body = record(req, raw.toString('utf8'));
            route(req, res, req.url.split('?')[0], body);
        });
    });

    // a WebSocket upgrade is recorded and refused with a plain 404
    server.on('upgrade', (req, socket) => {
        record(req, '');
        const s = JSON.stringify({ error: { message: 'websocket not supported',
            type: 'invalid_request_error' } });
        socket.end('HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n' +
            `content-length: ${Buffer.byteLength(s)}\r\nconnection: close\r\n\r\n${s}`);
    });

    server.listen(Number(port), '127.0.0.1', () => {
        process.stdout.write(`listening 127.0.0.1:${server.address().port}\n`);
    });
    for (const sig of ['SIGTERM', 'SIGINT'])
        process.on(sig, () => process.exit(0));
}
