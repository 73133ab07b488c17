#!/usr/bin/perl

# Tenants (examples/tenants.conf): llama_session_namespace from an API key
# (a map over Authorization) or from nginx's own authentication
# ($remote_user); two tenants that send the same session id never share a
# file or a slot's state.  And the API finds a client's id without the
# model it sent: every model's session under that id, ?model= to narrow,
# DELETE removes them all.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use MIME::Base64 ();

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 1);

open my $pw, '>', $t->dir . '/htpasswd' or die;
print $pw "carol:{PLAIN}c-secret\ndave:{PLAIN}d-secret\n";
close $pw;

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    http => q{
        map $http_authorization $llama_tenant {
            default                      "";
            "Bearer sk-team-alpha-5f2c"  alpha;
            "Bearer sk-team-beta-91d0"   beta;
        }
    },
    server => 'llama_session_namespace $llama_tenant;',
    location => q{
        if ($llama_tenant = "") { return 401; }
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Key $llama_session_key always;
    },
    extra => q{
        location /users/ {
            auth_basic "llama";
            auth_basic_user_file %%DIR%%/htpasswd;
            llama_session_namespace $remote_user;
            llama_session llama;
            proxy_pass http://127.0.0.1:%%LLAMA%%/;
            add_header X-S-Action $llama_session_action always;
            add_header X-S-Key $llama_session_key always;
        }

        location /api/ {
            if ($llama_tenant = "") { return 401; }
            llama_session_api llama;
        }
    }));

my %auth = (alpha => 'Bearer sk-team-alpha-5f2c',
            beta  => 'Bearer sk-team-beta-91d0');

sub turn {
    my ($path, $headers, $text, $model) = @_;
    my $r = $t->post($path,
                     { model => $model // 'm1',
                       messages => [ { role => 'user', content => $text } ],
                       max_tokens => 4 },
                     headers => $headers);
    return $r;
}

sub as { my ($tenant) = @_;
         return { Authorization => $auth{$tenant}, 'X-Session-Id' => 'chat-1' } }

is(turn('/v1/chat/completions', { 'X-Session-Id' => 'chat-1' }, 'x')->{status},
   401, 'no key: 401');

my $a1 = turn('/v1/chat/completions', as('alpha'), 'alpha: ' . 'A' x 400);
is($a1->{status}, 200, 'alpha, chat-1');
my $b1 = turn('/v1/chat/completions', as('beta'), 'alpha: ' . 'A' x 400);
is($b1->{status}, 200, 'beta, chat-1, the very same messages');
isnt($b1->{headers}{'x-s-key'}, $a1->{headers}{'x-s-key'},
     'another key for the same id');
isnt($b1->{headers}{'x-s-action'}, 'hit', 'beta does not get alpha\'s slot');
is($b1->{json}{timings}{cache_n}, 0, 'nothing of alpha\'s state is reused');

my $a2 = turn('/v1/chat/completions', as('alpha'), 'alpha: ' . 'A' x 400);
is($a2->{headers}{'x-s-action'}, 'restore', 'alpha comes back: its file');
ok($a2->{json}{timings}{cache_n} > 400, 'with its whole state');

my @files = map { s{.*/}{}r } glob($t->dir . '/slots/*.bin');
is(scalar @files, 2, 'two files, one per tenant: ' . join ' ', @files);

# nginx's own users as tenants

my $c = turn('/users/v1/chat/completions',
             { Authorization => 'Basic ' . MIME::Base64::encode_base64('carol:c-secret', ''),
               'X-Session-Id' => 'chat-1' }, 'carol: ' . 'C' x 300);
my $d = turn('/users/v1/chat/completions',
             { Authorization => 'Basic ' . MIME::Base64::encode_base64('dave:d-secret', ''),
               'X-Session-Id' => 'chat-1' }, 'carol: ' . 'C' x 300);
is($c->{status}, 200, 'carol through auth_basic');
isnt($c->{headers}{'x-s-key'}, $d->{headers}{'x-s-key'},
     'dave, same id: another key');
is($d->{json}{timings}{cache_n}, 0, 'and nothing of carol\'s state');

# the API by the client's id, whatever the model

turn('/v1/chat/completions', as('alpha'), 'alpha on m2: ' . 'B' x 200, 'm2');
turn('/v1/chat/completions', as('beta'), 'beta again');   # takes the slot
my $l = $t->get('/api/sessions/chat-1', headers => { Authorization => $auth{alpha} });
is($l->{status}, 200, 'GET the id without ?model=');
my @models = sort map { $_->{model} } @{ $l->{json}{files} // [] };
is_deeply(\@models, [ 'm1', 'm2' ], 'both of alpha\'s models\' sessions')
    or diag $l->{content};

$l = $t->get('/api/sessions/chat-1?model=m2', headers => { Authorization => $auth{alpha} });
is_deeply([ map { $_->{model} } @{ $l->{json}{files} // [] } ], [ 'm2' ],
          '?model= narrows it');

my $del = $t->request('DELETE', '/api/sessions/chat-1',
                      headers => { Authorization => $auth{alpha} });
is($del->{status}, 200, 'DELETE the id without ?model=');
is($t->get('/api/sessions/chat-1', headers => { Authorization => $auth{alpha} })->{status},
   404, 'all of alpha\'s sessions under it are gone');
is($t->get('/api/sessions/chat-1', headers => { Authorization => $auth{beta} })->{status},
   200, 'beta\'s session under the same id stays');

# the isolation review: every API verb stays in the caller's namespace

sub api_as {
    my ($tenant, $m, $path) = @_;
    return $t->request($m, $path, headers => { Authorization => $auth{$tenant} },
                       $m eq 'POST' ? (body => '') : ());
}

turn('/v1/chat/completions', as('beta'), 'beta keeps this: ' . 'Z' x 300);
my $bkey = api_as('beta', 'GET', '/api/sessions/current')->{json}{slots}[0]{session}{key};
like($bkey // '', qr/^chat-1-/, 'beta\'s session is in the slot');

my $la = api_as('alpha', 'GET', '/api/sessions');
ok(!grep({ $_->{key} eq $bkey } @{ $la->{json}{sessions} // [] }),
   'alpha\'s list has none of beta\'s sessions');
my @beta_ids = grep { $_->{key} ne $bkey } @{ api_as('beta', 'GET', '/api/sessions')->{json}{sessions} };
ok(!grep({ my $k = $_->{key}; grep { $_->{key} eq $k } @{ $la->{json}{sessions} } } @beta_ids),
   'not even the saved ones');
is(api_as('alpha', 'GET', "/api/sessions/$bkey")->{status}, 404,
   'alpha cannot read beta\'s session by its key');
my $cur = api_as('alpha', 'GET', '/api/sessions/current')->{json};
is($cur->{slots}[0]{state}, 'other', 'alpha sees the slot used, by another');
is($cur->{slots}[0]{session}, undef, 'and nothing of the session in it');
my $cl = api_as('alpha', 'POST', '/api/sessions/clear');
is($cl->{status}, 200, 'alpha\'s clear');
is(scalar @{ $cl->{json}{cleared} // [] }, 0, 'erases none of beta\'s slots');
my $sv = api_as('alpha', 'POST', '/api/sessions/save');
is(scalar @{ $sv->{json}{saved} // [] }, 0, 'nor does its save');
my $b3 = turn('/v1/chat/completions', as('beta'), 'beta keeps this: ' . 'Z' x 300);
is($b3->{headers}{'x-s-action'}, 'hit', 'beta\'s state is still in the slot');

# beta's saved file, by its key: alpha can neither read nor delete it
my ($bfile) = grep { $_->{saved_at} } @{ api_as('beta', 'GET', '/api/sessions')->{json}{sessions} };
ok($bfile, 'beta has a saved file');
is(api_as('alpha', 'DELETE', "/api/sessions/$bfile->{key}")->{status}, 404,
   'alpha\'s DELETE of beta\'s key: 404');
is(api_as('beta', 'GET', "/api/sessions/$bfile->{key}")->{status}, 200,
   'the file is still there for beta');
my $mine = api_as('beta', 'POST', '/api/sessions/clear');
is(scalar @{ $mine->{json}{cleared} // [] }, 1, 'beta clears its own slot');

# after a restart of nginx the files' tenants come from their .json
$t->stop_nginx;
$t->start_nginx;
ok(!grep({ $_->{key} eq $bfile->{key} }
         @{ api_as('alpha', 'GET', '/api/sessions')->{json}{sessions} // [] }),
   'after a restart alpha\'s list still has none of beta\'s files');
ok(grep({ $_->{key} eq $bfile->{key} }
        @{ api_as('beta', 'GET', '/api/sessions')->{json}{sessions} // [] }),
   'beta\'s has them');

$t->stop;
done_testing;
