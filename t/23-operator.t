#!/usr/bin/perl

# What an operator looks for (the fake backend): the API finds a session by
# an id with "/" (in the path, and as ?id= for ids the path cannot carry)
# and says it is in a slot; a slot call that runs out of the slots
# location's proxy_read_timeout names the call and the directive; an idle
# save is logged in the error_log of the zone's location.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 1);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=1 store=%%SLOTS%% save_idle=1s;',
    location => q{
        error_log %%DIR%%/site-error.log info;
        add_header X-S-Action $llama_session_action always;
    },
    slots => 'proxy_read_timeout 1s;',
    extra => q{
        location /api/ {
            llama_session_api llama;
        }

        location /closed/ {
            llama_session_api llama;
            deny all;
            error_page 403 @json403;
        }

        location @json403 {
            default_type application/json;
            return 403 '{"error":{"code":403,"message":"forbidden","type":"permission_error"}}\n';
        }
    }));

sub turn {
    my ($sid, $text) = @_;
    return $t->post('/completion', { prompt => "$sid: $text", n_predict => 4 },
                    headers => { 'X-Session-Id' => $sid });
}

is(turn('team/alice', 'one')->{status}, 200, 'team/alice');
is(turn('bob', 'one')->{status}, 200, 'bob takes the slot');
is(turn('team/alice', 'one two')->{headers}{'x-s-action'}, 'restore',
   'team/alice comes back');

my $cur = $t->get('/api/sessions/current')->{json};
my $key = $cur->{slots}[0]{session}{key} // '';
like($key, qr/^team_alice-/, 'the slot holds team/alice');

my $r = $t->get('/api/sessions/team%2Falice');
is($r->{status}, 200, 'GET .../sessions/team%2Falice');
ok($r->{json}{files}[0]{in_slot}, 'says it is in the slot')
    or diag explain $r->{json};
$r = $t->get("/api/sessions/$key");
ok($r->{json}{files}[0]{in_slot}, 'so does GET by its key');
$r = $t->get('/api/sessions?id=team%2Falice');
is($r->{status}, 200, 'GET .../sessions?id=team%2Falice');
is($r->{json}{key}, $key, 'finds it');
ok($r->{json}{files}[0]{in_slot}, 'in the slot');

is(turn('../up', 'one')->{status}, 200, 'a session "../up"');
is(turn('bob', 'two')->{status}, 200, 'bob again');
$r = $t->get('/api/sessions?id=..%2Fup');
is($r->{status}, 200, '?id=..%2Fup reaches it');
ok(!$r->{json}{files}[0]{in_slot}, 'not in the slot now');
$r = $t->request('DELETE', '/api/sessions?id=..%2Fup');
is($r->{status}, 200, 'DELETE .../sessions?id=..%2Fup');
is(scalar(@{ $r->{json}{deleted} }), 1, 'deletes its file');
is($t->request('POST', '/api/sessions?id=x', body => {})->{status}, 405,
   'POST with ?id=: 405');

# model management is not for clients, router or not
is($t->post('/models/load', { model => 'x' })->{status}, 403,
   'a client\'s POST /models/load: 403');
is($t->post('/models/unload', { model => 'x' })->{status}, 403,
   'and /models/unload');

# nginx's own refusal, made JSON as docs/api.md shows
$r = $t->get('/closed/sessions');
is($r->{status}, 403, 'deny: 403');
is($r->{json}{error}{type}, 'permission_error', 'as JSON, with error_page');

# the idle save, in the location's error_log

ok($t->wait_for(sub { $t->read_file('site-error.log')
                      =~ /idle save of "bob-\w+" from slot 0 of zone "llama"/ }, 10),
   'the idle save is logged in the error_log of the zone\'s location');

# a save that takes longer than the slots location's proxy_read_timeout

$t->fake_script({ save => { delay_ms => 2500 } });
is(turn('carol', 'one')->{status}, 200, 'carol takes the slot (bob was saved)');
$r = turn('dave', 'one');
is($r->{status}, 502, 'dave: the save of carol times out: 502');
like($r->{json}{error}{message} // '',
     qr/did not answer a slot call \(save\) in time/,
     'the client is told which call did not answer in time');
like($t->read_file('site-error.log'),
     qr/slot call "save" for session "\S+" timed out in the location of "\/_llama_slots\/[^"]*": raise proxy_read_timeout there/,
     'the error log names the call and the directive to raise');
$t->fake_script({});

# OpenAI's transcriptions take a slot too: through the queue, as "default"
is(turn('eve', 'one')->{status}, 200, 'eve in the slot');
my $form = "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
         . "Content-Type: audio/wav\r\n\r\nRIFF....WAVE\r\n--XyZ--\r\n";
my $tr = $t->request('POST', '/v1/audio/transcriptions', body => $form,
                     headers => { 'Content-Type' => 'multipart/form-data; boundary=XyZ' });
ok($tr->{headers}{'x-s-action'} && $tr->{headers}{'x-s-action'} ne 'bypass',
   'a transcription goes through the slot\'s queue: '
   . ($tr->{headers}{'x-s-action'} // 'none'));
like($t->read_file('site-error.log'), qr/out "eve-\w+" saved .* in "default"/,
     'eve is saved before it runs');

$t->stop;
done_testing;
