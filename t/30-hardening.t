#!/usr/bin/perl

# The first review's defects, each as a user or an attacker would meet it,
# against the fake backend: memory a body controls, a zone full of session
# records, a client that leaves during a restore, saves that must not
# write an empty, short or foreign state over a good file, error_page and
# SSI over the module's own locations, a reload that resizes the zone,
# X-Conversation-Id and the replayable streams, the allow-list of
# inference endpoints, the model in the fingerprint, ids too long, the
# namespaced default session, the slot held through lingering close,
# .json sidecars of long ids, a symbolic link for a temporary file, and
# two session names with the same crc32.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use Compress::Zlib qw(crc32);
use Digest::SHA qw(sha256_hex);
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

# a turn of a conversation: the same first message, then the text (the
# first message is part of the session's key)
sub chat_of { LlamaTest::conversation($_[0]) }

sub key {
    my ($id, %o) = @_;
    return LlamaTest::session_key($id, %o, body => chat_of(''));
}

my $fp = LlamaTest::fake_fp('fake.gguf');

my $chat = chat_of('hello');

# the workers of the running nginx and their peak memory (kB)
sub workers {
    my ($t) = @_;
    my $master = $t->{pids}{nginx};
    my @w;
    for my $d (glob '/proc/[0-9]*') {
        open my $fh, '<', "$d/stat" or next;
        my $stat = <$fh>;
        close $fh;
        my ($ppid) = $stat =~ /\)\s+\S+\s+(\d+)/ or next;
        next unless $ppid == $master;
        open $fh, '<', "$d/cmdline" or next;
        my $cmd = <$fh> // '';
        close $fh;
        push @w, $d =~ s{/proc/}{}r if $cmd =~ /worker process/;
    }
    return @w;
}

sub hwm {
    my ($pid) = @_;
    open my $fh, '<', "/proc/$pid/status" or return 0;
    my ($kb) = join('', <$fh>) =~ /VmHWM:\s+(\d+)/;
    return $kb // 0;
}

sub peaks { my ($t) = @_; return { map { $_ => hwm($_) } workers($t) } }

sub grown {
    my ($before, $t) = @_;
    my $max = 0;
    for my $pid (keys %$before) {
        my $d = hwm($pid) - $before->{$pid};
        $max = $d if $d > $max;
    }
    return $max;
}

# the site of every case but its zone (LlamaTest::site)
my %STD = (
    upstream => '',
    http => q{
        # a cache manager and loader run beside the workers
        proxy_cache_path %%DIR%%/cache keys_zone=cache:1m;
    },
    server => q{
        client_max_body_size 32m;

        add_header X-S-Id $llama_session_id always;
        add_header X-S-Key $llama_session_key always;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Wait $llama_session_wait_ms always;
    },
    location => 'proxy_buffering off;',
    slots => 'error_page 500 502 503 504 /50x.html;',
    extra => q{
        location /linger/ {
            llama_session llama;
            lingering_close always;
            lingering_timeout 5s;
            proxy_pass http://llama/;
        }

        location /tenant/ {
            llama_session llama;
            llama_session_namespace $http_x_tenant;
            proxy_pass http://llama/;
        }

        location /mirrored/ {
            llama_session llama;
            mirror /mirror;
            proxy_pass http://llama/;
        }

        location = /mirror {
            internal;
            llama_session llama;
            proxy_pass http://llama/v1/chat/completions;
        }

        location /ssi/ {
            ssi on;
            ssi_types *;
            root %%DIR%%/html;
        }

        location = /50x.html {
            root %%DIR%%/html;
        }

        location /api/ {
            llama_session_api llama;
        }
    });

sub ask {
    my ($t, $sid, %o) = @_;
    my $path = $o{path} // '/v1/chat/completions';
    return $t->post($path, $o{body} // $chat,
                    headers => { defined $sid ? ('X-Session-Id' => $sid) : (),
                                 %{ $o{headers} // {} } });
}

sub slot_calls {
    my ($t) = @_;
    return grep { $_->{path} =~ m{^/slots} } @{ $t->fake_calls };
}

sub completions {
    my ($t) = @_;
    return grep { $_->{path} !~ m{^/slots} && $_->{method} eq 'POST'
                  && !LlamaTest::prefix_call($_) }
           @{ $t->fake_calls };
}

sub setup {
    my (%o) = @_;
    my $t = LlamaTest->new(workers => $o{workers} // 2);
    mkdir $t->dir . '/html';
    open my $fh, '>', $t->dir . '/html/50x.html' or die;
    print $fh "<html><body>50x</body></html>\n";
    close $fh;
    mkdir $t->dir . '/html/ssi';
    open $fh, '>', $t->dir . '/html/ssi/page.shtml' or die;
    print $fh "before <!--# include virtual=\"/api/sessions/current\" -->"
              . " after\n";
    close $fh;
    $t->fake(%{ $o{fake} // {} });
    my $zone = $o{zone} // 'llama_session_zone zone=llama:1m store=%%SLOTS%%;';
    $t->nginx($t->site(zone => $zone, %STD));
    return $t;
}

# 1. memory a body controls: 16,000 system messages, no id (the digest)
# 12. a 2 MB "model" of nested arrays (never parsed: not a string)
{
    my $t = setup();
    ask($t, 'warm');
    my $before = peaks($t);
    my $body = '{"model":[' . join(',', ('[]') x 500_000) . '],'
               . '"messages":[{"role":"user","content":"hi"}]}';
    my $r = $t->post('/v1/chat/completions', $body,
                     headers => { 'Content-Type' => 'application/json',
                                  'X-Session-Id' => 'arrays' });
    is($r->{status}, 200, 'a 2 MB model of nested arrays: 200');
    my $g = grown($before, $t);
    cmp_ok($g, '<', 24 * 1024, "and the worker's peak grew ${g} kB only");

    $before = peaks($t);
    $body = { messages => [ (map { { role => 'system', content => 'a' } }
                                 1 .. 16_000),
                            { role => 'user', content => 'hi' } ] };
    $r = ask($t, undef, body => $body);
    is($r->{status}, 200, '16,000 system messages: 200');
    like($r->{headers}{'x-s-id'}, qr/^sys-[0-9a-f]{16}$/,
         'the session is the system prompt\'s digest');
    $g = grown($before, $t);
    cmp_ok($g, '<', 32 * 1024,
           "the worker's peak grew ${g} kB (was 234 MB)");

    # the digest is the one of the prompt joined by newlines
    my $sys = join "\n", ('a') x 16_000;
    is($r->{headers}{'x-s-id'}, 'sys-' . substr(sha256_hex($sys), 0, 16),
       'and it is SHA-256 of the system texts joined by newlines');

    # 12. ids too long: 400 with a JSON error, never a key
    $r = ask($t, 'x' x 300);
    is($r->{status}, 400, 'an id header of 300 bytes: 400');
    is($r->{json}{error}{type}, 'invalid_request_error', 'a JSON error');
    $r = ask($t, undef, body => { %$chat, session_id => 'y' x 300 });
    is($r->{status}, 400, 'an id field of 300 bytes: 400');
    $r = ask($t, undef, body => { %$chat, session_id => 'z' x 256 });
    is($r->{status}, 200, 'an id of 256 bytes is fine');

    $t->stop;
}

# 2. a zone full of session records still queues every waiter
{
    my $t = setup(zone => 'llama_session_zone zone=llama:64k;');
    for my $i (1 .. 400) {
        my $r = ask($t, "one-$i");
        if ($r->{status} != 200) {
            fail("session $i: $r->{status}");
            last;
        }
    }
    my $cur = $t->get('/api/sessions/current')->{json};
    cmp_ok($cur->{stats}{forgotten}, '>', 0,
           'the zone forgot records to make room')
        or diag $JSON->encode($cur);
    cmp_ok($cur->{max_waiting}, '>=', 32, 'and shows how many may wait');

    $t->fake_script({ completion => { delay_ms => 300 } });
    my @h = map { $t->async_post('/v1/chat/completions', $chat,
                                 headers => { 'X-Session-Id' => "busy-$_" }) }
            1 .. 6;
    my @st = map { $t->async_wait($_)->{status} } @h;
    is_deeply(\@st, [ (200) x 6 ],
              'six concurrent requests after 400 sessions: all served');
    ok(!$t->log_lines(qr/no room for another waiting request/),
       'no waiter was refused for want of memory');
    $t->fake_script({});
    $t->stop;
}

# 3. a client that leaves during a restore: the slot is unknown, never a hit
# 4. no save of an empty, short or foreign state over a good file
{
    my $t = setup();
    my $slots = $t->dir . '/slots';
    my $a = key('alpha');
    ask($t, 'alpha', body => chat_of('alpha text'));
    ask($t, 'beta', body => chat_of('beta text'));          # alpha saved
    ok(-e "$slots/$a.$fp.bin", 'alpha has a file');

    $t->fake_script({ restore => { delay_ms => 800 } });
    my $s = $t->raw_open('POST', '/v1/chat/completions', chat_of('alpha 2'),
                         headers => { 'X-Session-Id' => 'alpha' });
    ok($t->wait_for(sub { grep { $_->{query} eq 'action=restore' }
                          slot_calls($t) }, 5), 'a restore started');
    sleep 0.2;       # a fixed time: the client leaves within the 800 ms restore
    close $s;
    $t->wait_for(sub { $t->log_lines(qr/ended during a restore of slot 0/) },
                 10);
    $t->fake_script({});

    my $r = ask($t, 'beta', body => chat_of('beta text 2'));
    is($r->{status}, 200, 'beta after a client left during a restore');
    isnt($r->{headers}{'x-s-action'}, 'hit',
         'beta is no hit: the slot held alpha\'s restored state');
    is($r->{headers}{'x-s-action'}, 'restore', 'beta is restored');
    ok($t->log_lines(qr/ended during a restore of slot 0, whose content is unknown/),
       'the error log says the slot is unknown');
    my $b = key('beta');
    unlike($t->read_file("$slots/$b.$fp.bin"), qr/alpha/,
           'beta\'s file holds no state of alpha');

    # a save answered 200 with a short file: the previous file stays
    my $good = $t->read_file("$slots/$b.$fp.bin");
    $t->fake_script({ save => { short => 1 } });
    $r = ask($t, 'alpha', body => chat_of('alpha 3'));
    is($r->{status}, 200, 'a short save: the request goes on');
    is($t->read_file("$slots/$b.$fp.bin"), $good,
       'beta\'s previous file is untouched');
    ok($t->log_lines(qr/is not the file llama-server said it wrote/),
       'the short file is logged');
    ok(!glob("$slots/*.tmp"), 'no temporary file stays');
    $t->fake_script({});

    # the API's save right after llama-server restarted: nothing is saved
    ask($t, 'beta', body => chat_of('beta text 3'));   # alpha saved
    my $afile = "$slots/$a.$fp.bin";
    my $agood = $t->read_file($afile);
    ask($t, 'alpha', body => chat_of('alpha 4'));      # alpha dirty again
    $t->stop_proc('fake');
    $t->fake(port => $t->{llama_port}{fake});
    my $before = () = slot_calls($t);
    $r = $t->post('/api/sessions/save', {});
    is($r->{status}, 200, 'the API save after a restart answers');
    is($t->read_file($afile), $agood,
       'alpha\'s file is not replaced by the restarted, empty slot');
    my @after = (slot_calls($t))[$before .. scalar(slot_calls($t)) - 1];
    ok(!(grep { $_->{query} eq 'action=save' } @after),
       'no save was even asked of the restarted backend');

    # --no-slots: the module cannot look, so it never saves
    ask($t, 'alpha', body => chat_of('alpha 5'));      # a fresh alpha, dirty
    $agood = $t->read_file($afile);
    $t->stop_proc('fake');
    $t->fake(port => $t->{llama_port}{fake},
             script => { slots => { status => 501 } });
    $r = ask($t, 'gamma');
    is($r->{status}, 200, 'with --no-slots the request goes on');
    is($t->read_file($afile), $agood,
       'and alpha\'s file is not replaced by what the slot may hold');
    ok($t->log_lines(qr/cannot check the slot and does not save/),
       'the error log says why');
    $t->fake_script({});

    $t->stop;
}

# 5. error_page over the slots location; 6. SSI and mirror subrequests
{
    my $t = setup();
    my $r = $t->get('/ssi/page.shtml');
    is($r->{status}, 200, 'a page that includes the API through SSI');
    unlike($r->{content}, qr/"slots"/, 'gets no API output');
    ok($t->log_lines(qr/refused a subrequest to the management API/),
       'the refusal is logged');

    ask($t, 'mirror-warm');
    my $n = () = completions($t);
    $r = ask($t, 'mirrored', path => '/mirrored/v1/chat/completions');
    is($r->{status}, 200, 'a mirrored inference request is served');
    $t->wait_for(sub { $t->log_lines(qr/refused a subrequest to "\/mirror"/) },
                 10);
    is(scalar(() = completions($t)), $n + 1,
       'the mirror subrequest never reached the backend');
    ok($t->log_lines(qr/refused a subrequest to "\/mirror"/),
       'the refused mirror is logged');

    $t->stop_proc('fake');
    $r = ask($t, 'nobody-home');
    is($r->{status}, 502, 'the backend is down: 502');
    like($r->{content}, qr/^\{"error"/,
         'a JSON error, not the error_page of the slots location');
    unlike($r->{content}, qr/<html>/i, 'no HTML in the response');
    $t->stop;
}

# 7. a reload that resizes the zone is refused
{
    my $t = setup();
    ask($t, 'before');
    my $conf = $t->read_file('nginx.conf');
    $conf =~ s/zone=llama:1m/zone=llama:2m/ or die;
    open my $fh, '>', $t->dir . '/nginx.conf' or die;
    print $fh $conf;
    close $fh;
    $t->allow_alerts(qr/cannot change its size/);
    kill 'HUP', $t->{pids}{nginx};
    ok($t->wait_for(sub { $t->log_lines(
        qr/\[emerg\].*llama_session zone "llama" cannot change its size from 1048576 to 2097152/) }, 10),
       'a reload with another zone size is refused, with the sizes');
    is(ask($t, 'after')->{status}, 200, 'the running configuration serves on');
    $t->stop;
}

# 9. X-Conversation-Id never reaches llama-server; its streams are refused
# 10. only inference endpoints take the slot
{
    my $t = setup();
    my $r = ask($t, undef, headers => { 'X-Conversation-Id' => 'conv-9' });
    is($r->{headers}{'x-s-id'}, 'conv-9', 'X-Conversation-Id names the session');
    my ($last) = reverse completions($t);
    ok(!exists $last->{headers}{'x-conversation-id'},
       'but llama-server never sees it');
    $r = $t->get('/v1/stream?conv_id=conv-9');
    is($r->{status}, 403, 'GET /v1/stream: 403');
    is($r->{json}{error}{type}, 'permission_error', 'with a JSON error');
    $r = $t->request('DELETE', '/v1/stream?conv_id=conv-9');
    is($r->{status}, 403, 'DELETE /v1/stream: 403');
    $r = $t->post('/v1/streams/lookup', { conv_id => 'conv-9' });
    is($r->{status}, 403, 'POST /v1/streams/lookup: 403');
    $r = $t->post('/slots/0?action=erase', {});
    is($r->{status}, 403, 'a client\'s slot action: 403');

    my $calls = () = slot_calls($t);
    for my $p ('/v1/chat/completions/control', '/v1/messages/count_tokens',
               '/tools', '/tokenize', '/apply-template')
    {
        $r = ask($t, 'other-session', path => $p);
        is($r->{headers}{'x-s-action'}, 'bypass', "POST $p passes by");
    }
    is(scalar(() = slot_calls($t)), $calls, 'without a slot call');
    for my $p ('/v1/chat/completions', '/completion', '/v1/completions',
               '/v1/messages', '/v1/responses', '/infill')
    {
        $r = ask($t, 'inference', path => $p);
        like($r->{headers}{'x-s-action'} // '', qr/^(hit|fresh|restore)$/,
             "POST $p takes the slot");
    }
    $t->stop;
}

# 11. another model at the same path (a requant): its files are stale
{
    my $t = setup();
    my $slots = $t->dir . '/slots';
    ask($t, 'model-a');
    ask($t, 'model-b');
    ok(-e "$slots/" . key('model-a') . ".$fp.bin", 'model-a is saved');
    is(ask($t, 'model-a')->{headers}{'x-s-action'}, 'restore',
       'and restored');
    $t->stop_proc('fake');
    my $port = $t->{llama_port}{fake};
    $t->fake(port => $port, meta => { n_vocab => 32000, size => 2000000 });
    my $r = ask($t, 'model-c');
    is($r->{headers}{'x-s-action'}, 'fresh', 'another session after it');
    $r = ask($t, 'model-a');
    is($r->{headers}{'x-s-action'}, 'fresh',
       'after a requant at the same path, model-a starts fresh');
    my $fp2 = LlamaTest::fake_fp('fake.gguf',
                                 meta => { n_vocab => 32000, size => 2000000 });
    isnt($fp2, $fp, 'the fingerprint changed with the model\'s size');
    my @last = (slot_calls($t))[-3 .. -1];
    ok(!(grep { $_->{query} eq 'action=restore'
                && $_->{body} =~ /\Q$fp\E/ } @last),
       'the old file was not restored');
    $t->stop;
}

# 13. tenants never share the default session
{
    my $t = setup();
    my $r = $t->post('/tenant/v1/chat/completions', chat_of('secret prompt'),
                     headers => { 'X-Tenant' => 'one' });
    is($r->{headers}{'x-s-id'}, 'default', 'tenant one without an id');
    $r = $t->post('/tenant/v1/chat/completions', chat_of('secret prompt'),
                  headers => { 'X-Tenant' => 'two' });
    isnt($r->{headers}{'x-s-action'}, 'hit',
         'tenant two\'s default session is not tenant one\'s');
    is($r->{json}{usage}{prompt_tokens_details}{cached_tokens}, 0,
       'and it learns nothing of its prompt');
    like($r->{headers}{'x-s-key'}, qr/^default-[0-9a-f]{24}$/,
         'its key is namespaced');
    $t->stop;
}

# 16. a slot llama-server keeps running is polled with a backoff
{
    my $t = setup();
    ask($t, 'poll-a');
    $t->fake_script({ slots => { processing => 1 } });
    my $h = $t->async_post('/v1/chat/completions', $chat,
                           headers => { 'X-Session-Id' => 'poll-b' });
    sleep 3;         # a fixed time: the GET /slots are counted over 3 s
    $t->fake_script({});
    is($t->async_wait($h)->{status}, 200, 'served once the slot is idle');
    my $gets = grep { $_->{method} eq 'GET' && $_->{path} eq '/slots' }
               @{ $t->fake_calls };
    cmp_ok($gets, '<', 20, "GET /slots asked $gets times in 3 s (was 120)");
    $t->stop;
}

# 17. the slot is given back when the response ends, not after lingering
{
    my $t = setup();
    ask($t, 'linger-warm');
    my $s = $t->raw_open('POST', '/linger/v1/chat/completions', $chat,
                         headers => { 'X-Session-Id' => 'lingerer' });
    my $resp = '';
    while (my $line = <$s>) { $resp .= $line; last if $resp =~ /"content"/ }
    like($resp, qr/200/, 'a response with lingering close');
    my $r = ask($t, 'next-one');
    is($r->{status}, 200, 'the next session');
    cmp_ok($r->{headers}{'x-s-wait'}, '<', 1000,
           "waited $r->{headers}{'x-s-wait'} ms, not the lingering timeout");
    close $s;
    $t->stop;
}

# 18. a .json sidecar of an id of 100 bytes keeps its model
# 20. a symbolic link for a temporary file is never committed
{
    my $t = setup();
    my $slots = $t->dir . '/slots';
    my $long = 'L' x 100;
    ask($t, $long, body => { %$chat, model => 'm1' });
    ask($t, 'other');
    my $k = key($long, model => 'm1');
    my $meta = eval { $JSON->decode($t->read_file("$slots/$k.$fp.json")) };
    is($meta->{model}, 'm1', 'the .json of a 100-byte id keeps its model');
    is(length $meta->{id}, 96, 'and the id as far as it is kept');

    my $target = $t->dir . '/outside';
    open my $fh, '>', $target or die;
    print $fh 'outside';
    close $fh;
    my $o = key('other');
    symlink $target, "$slots/$o.$fp.bin.tmp" or die;
    ask($t, 'third');                                 # other is saved
    ok(!-l "$slots/$o.$fp.bin", 'a link is never renamed into place');
    ok($t->log_lines(qr/is not the file llama-server said it wrote/),
       'the refusal is logged');
    $t->stop;
}

# 19. the API notices a client that leaves while it waits for the slot
{
    my $t = setup();
    ask($t, 'api-a');
    $t->fake_script({ completion => { delay_ms => 3000 } });
    my $h = $t->async_post('/v1/chat/completions', $chat,
                           headers => { 'X-Session-Id' => 'api-b' });
    $t->wait_for(sub { grep { ($_->{headers}{'x-session-id'} // '') eq 'api-b' }
                       completions($t) }, 10);
    my $s = $t->raw_open('POST', '/api/sessions/save', {});
    # a fixed time: the API's wait for the slot shows nowhere (it is no
    # waiter of the zone's queue), and the slot stays busy for 3 s
    sleep 0.3;
    close $s;
    my $t0 = time;
    ok($t->wait_for(sub { $t->read_file('access.log')
                          =~ m{"POST /api/sessions/save HTTP/1.1" 499} }, 2),
       'the API request that lost its client ends at once (499)');
    $t->async_wait($h);
    $t->fake_script({});
    $t->stop;
}

# 21. two session names with the same crc32 are both found
{
    my $t = setup();
    my (%seen, @pair);
    for my $i (1 .. 300_000) {
        my $name = key("c$i") . ".$fp";
        my $c = crc32($name);
        if (exists $seen{$c}) { @pair = ("c$seen{$c}", "c$i"); last }
        $seen{$c} = $i;
    }
    SKIP: {
        skip 'no crc32 collision found', 4 unless @pair;
        for (1 .. 3) {
            ask($t, $pair[0]);
            ask($t, $pair[1]);
        }
        my $list = $t->get('/api/sessions')->{json};
        is($list->{files}, 2, "two ids with one crc32 ($pair[0], $pair[1]) "
                              . 'make two files, no duplicate records')
            or diag $JSON->encode($list);
        is($t->get('/api/sessions/' . key($pair[0]))->{status}, 200,
           'the first is found');
        is($t->get('/api/sessions/' . key($pair[1]))->{status}, 200,
           'the second is found');
        is(ask($t, $pair[0])->{headers}{'x-s-action'}, 'restore',
           'and restored');
    }
    $t->stop;
}

# a large file is deleted in steps, off the request's time
{
    my $t = setup();
    my $slots = $t->dir . '/slots';
    ask($t, 'huge', body => chat_of('huge text'));
    ask($t, 'tiny', body => chat_of('tiny text'));          # huge saved
    my $k = key('huge');
    my $f = "$slots/$k.$fp.bin";
    ok(-e $f, 'huge has a file');
    truncate $f, 300 * 1024 * 1024;                 # a sparse 300 MB state
    my $r = $t->request('DELETE', "/api/sessions/$k");
    is($r->{status}, 200, 'DELETE a 300 MB session');
    # (in a thread of the store's: by its name; thread_pool=off, t/24:
    # renamed to .del and cut in steps)
    ok($t->wait_for(sub { !-e $f }, 5), 'its file is gone from its name');
    ok($t->wait_for(sub { !glob("$slots/*.del") }, 5),
       'and deleted within a second or so');
    $t->stop;
}

# 14. idle saves in workers only, and they back off while llama-server is
# down instead of failing every 50 ms
{
    my $t = setup(zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
                          . 'save_idle=200ms;');
    for my $i (1 .. 6) {
        ask($t, "idle-$i");
        ok($t->wait_for(sub { $t->log_lines(qr/idle save of "idle-$i-\w+"/) },
                        5), "idle save $i");
    }

    # the master logs the processes it starts (titles differ under
    # valgrind); read after the saves: under valgrind a worker's start may
    # be logged late
    my %workers = map { /start worker process (\d+)/ ? ($1 => 1) : () }
                  $t->log_lines(qr/start worker process/);
    my @by = map { /\[info\] (\d+)#/ ? $1 : () }
             $t->log_lines(qr/idle save of "idle-/);
    is(scalar(grep { !$workers{$_} } @by), 0,
       'every idle save was made by a worker, not the cache manager or '
       . 'loader') or diag "@by / " . join(' ', keys %workers);
    ask($t, 'idle-b');
    $t->stop_proc('fake');
    sleep 4;         # a fixed time: the tries are counted over 4 s
    my $n = () = $t->log_lines(qr/\(111: Connection refused\)/);
    cmp_ok($n, '>=', 1, 'an idle save that cannot connect is logged');
    cmp_ok($n, '<=', 8, "$n tries in 4 s from 2 workers: they back off "
                        . '(every 50 ms before)');
    $t->stop;
}

# a request whose client left before llama-server answered may still run
# in llama-server later: the slot is not swapped until it would have
{
    my $t = setup();
    my $slots = $t->dir . '/slots';
    ask($t, 'kilo', body => chat_of('kilo text'));
    ask($t, 'foxtrot', body => chat_of('foxtrot text'));    # kilo saved
    $t->fake_script({ completion => { pre_ms => 800,
                                      path => '/v1/completions' } });
    my $s = $t->raw_open('POST', '/v1/completions', chat_of('foxtrot 2'),
                         headers => { 'X-Session-Id' => 'foxtrot' });
    $t->wait_for(sub { grep { $_->{path} eq '/v1/completions' } completions($t) },
                 10);
    close $s;
    # a fixed time, short: nginx sees the client gone (within llama-server's
    # 800 ms before the request takes the slot) before kilo asks
    sleep 0.05;
    my $t0 = time;
    my $r = ask($t, 'kilo', body => chat_of('kilo text 2'));
    is($r->{status}, 200, 'the next session after a client left mid-request');
    cmp_ok(time - $t0, '>', 1, 'waited for the slot to be quiet');
    # a fixed time: had kilo not waited, the late request would have run
    # on the slot by then
    sleep 1;
    $t->fake_script({});
    ask($t, 'third', body => chat_of('third text'));          # kilo saved
    my $k = $t->read_file("$slots/" . key('kilo') . ".$fp.bin");
    like($k, qr/kilo text 2/, 'kilo\'s file holds kilo\'s turn');
    unlike($k, qr/foxtrot/, 'and nothing of the request that ran late');
    $t->stop;
}

# llama-server gone in the middle of a restore: 502, the slot unknown
{
    my $t = setup();
    ask($t, 'rho', body => chat_of('rho text'));
    ask($t, 'sigma', body => chat_of('sigma text'));        # rho saved
    $t->fake_script({ restore => { close => 1 } });
    my $r = ask($t, 'rho', body => chat_of('rho text 2'));
    is($r->{status}, 502, 'a restore without an answer: 502');
    is($r->{json}{error}{type}, 'server_error', 'with a JSON error');

    # llama-server back but loading its model: 503, retry soon
    $t->fake_script({ props => { status => 503, message => 'Loading model' } });
    $r = ask($t, 'sigma', body => chat_of('sigma text 2'));
    is($r->{status}, 503, 'llama-server loading its model: 503');
    is($r->{headers}{'retry-after'}, '1', 'with Retry-After');
    is($r->{json}{error}{type}, 'unavailable_error', 'and a JSON error');
    $t->fake_script({});
    $r = ask($t, 'sigma', body => chat_of('sigma text 2'));
    is($r->{status}, 200, 'the next request is served');
    is($r->{headers}{'x-s-action'}, 'restore',
       'restored, not a hit on the slot nobody can vouch for');
    $t->stop;
}

done_testing;
